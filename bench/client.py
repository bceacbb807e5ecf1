"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

The server-sent-event stream is parsed here (not by an SDK) so that the
arrival time of every chunk is taken the moment its line is read.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from tandem.bench.datasets import BenchRequest
from tandem.bench.metrics import RequestRecord

ENDPOINTS = ("chat", "completions")


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    endpoint: str = "chat"
    api_key: Optional[str] = None
    ignore_eos: bool = True  # send ignore_eos and min_tokens so answers have the drawn length
    temperature: float = 0.0
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def resolve_api_key(flag_value: Optional[str]) -> Optional[str]:
    return flag_value or os.environ.get("OPENAI_API_KEY") or None


def request_body(config: EndpointConfig, request: BenchRequest) -> dict:
    body: dict = {"model": config.model, "max_tokens": request.output_len, "temperature": config.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    else:
        body["prompt"] = request.prompt_text()
    if config.ignore_eos:
        # Extra fields that vLLM and tandem honour; servers that reject them need --no-ignore-eos.
        body["ignore_eos"] = True
        body["min_tokens"] = request.output_len
    return body


def chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send(client: httpx.AsyncClient, config: EndpointConfig, request: BenchRequest, index: int,
               bench_start: float) -> RequestRecord:
    """Send one request and time it. Never raises for a failed request: the
    record says what went wrong."""
    record = RequestRecord(index=index, prompt_len=request.prompt_len, expected_output_len=request.output_len,
                           group=request.group, turn=request.turn)
    try:
        await _stream(client, config, request, record, bench_start)
    finally:
        record.end_s = time.perf_counter() - bench_start
    return record


async def _stream(client: httpx.AsyncClient, config: EndpointConfig, request: BenchRequest, record: RequestRecord,
                  bench_start: float) -> None:
    sent = time.perf_counter()
    record.start_s = sent - bench_start
    last: Optional[float] = None
    chunks = 0
    usage: dict = {}
    try:
        async with client.stream("POST", config.url, json=request_body(config, request), headers=config.headers(),
                                 timeout=config.timeout_s) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk_text(chunk, config.endpoint):
                    continue  # role-only or usage-only chunks carry no token
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last)
                last = now
                chunks += 1
        record.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return
    if chunks == 0:
        record.error = "the stream ended without any text"
        return
    record.prompt_tokens = int(usage.get("prompt_tokens") or request.prompt_len)
    record.output_tokens = int(usage.get("completion_tokens") or chunks)
    record.success = True


def first_model(base_url: str, api_key: Optional[str]) -> str:
    """The first model the server lists (GET /models)."""
    url = f"{base_url.rstrip('/')}/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"error: could not read the model list at {url} ({exc}); "
                         "check --base-url (it ends in /v1) or pass --model") from None
