"""The OpenAI-compatible gateway of a real stack (`tandem up`: kvstore,
prefill, decode, router as processes on loopback) driven by the real `openai`
client, checked against the offline engine on the same model."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tandem.engine import LLM, SamplingParams
from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = 10

# 16 chats (all over --prefill-threshold, 32 tokens, with the chat template:
# they go through the prefill tier; short prompts are in the completions test).
LONG_SYSTEM = "You are a patient teacher who explains things simply and briefly. " * 2
TOPICS = ["rain", "the moon", "bread", "a river", "music", "snow", "a bridge", "tea"]
CHATS = ([[{"role": "user", "content": f"Say one thing about {t}."}] for t in TOPICS]
         + [[{"role": "system", "content": LONG_SYSTEM},
             {"role": "user", "content": f"In one sentence, what is {t}?"}] for t in TOPICS])


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("smollm2")


@pytest.fixture(scope="module")
def expected(offline) -> list[str]:
    prompts = [offline.chat_prompt(m) for m in CHATS]
    outs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs]


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)


async def chat_text(c: openai.AsyncOpenAI, model: str, messages: list[dict], stream: bool) -> str:
    if not stream:
        r = await c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0)
        return r.choices[0].message.content
    parts = []
    async for chunk in await c.chat.completions.create(model=model, messages=messages,
                                                       max_tokens=MAX_TOKENS, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def test_concurrent_chats_match_the_offline_engine(tandem_stack, expected):
    async def run(stream: bool) -> list[str]:
        c = client(tandem_stack)
        return await asyncio.gather(*(chat_text(c, tandem_stack.model, m, stream) for m in CHATS))

    assert asyncio.run(run(stream=False)) == expected
    assert asyncio.run(run(stream=True)) == expected
    assert tandem_stack.metric("router", "tandem:router_routing_decisions_total", target_role="prefill") >= 32


def test_streaming_usage_and_finish_reason(tandem_stack):
    async def run():
        c = client(tandem_stack)
        chunks = [ch async for ch in await c.chat.completions.create(
            model=tandem_stack.model, messages=CHATS[8], max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        return chunks

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 5
    assert usage.prompt_tokens > 32 and usage.total_tokens == usage.prompt_tokens + 5


def test_n_choices_and_logprobs(tandem_stack, expected):
    async def run():
        return await client(tandem_stack).chat.completions.create(
            model=tandem_stack.model, messages=CHATS[9], max_tokens=MAX_TOKENS, temperature=0, n=2,
            logprobs=True, top_logprobs=2)

    r = asyncio.run(run())
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.message.content == expected[9]  # greedy: every choice is the same
        tokens = choice.logprobs.content
        assert len(tokens) == r.usage.completion_tokens // 2
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
        # The chosen token is the most likely one under greedy decoding.
        assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4 for t in tokens)
    assert r.usage.completion_tokens == 2 * MAX_TOKENS


def test_short_completion_skips_prefill_and_streams_the_same_text(tandem_stack, offline):
    prompt = "The three primary colors are"
    skipped_before = tandem_stack.metric("router", "tandem:router_prefill_skipped_total")

    async def run():
        c = client(tandem_stack)
        kwargs = dict(model=tandem_stack.model, prompt=prompt, max_tokens=8, temperature=0)
        whole = await c.completions.create(**kwargs)
        parts = [ch.choices[0].text async for ch in await c.completions.create(stream=True, **kwargs)
                 if ch.choices]
        return whole, "".join(parts)

    whole, streamed = asyncio.run(run())
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert whole.choices[0].text == streamed == want and whole.usage.completion_tokens == 8
    # A 6-token prompt is under --prefill-threshold: decode prefilled it itself.
    assert tandem_stack.metric("router", "tandem:router_prefill_skipped_total") >= skipped_before + 2


def test_models_and_health(tandem_stack):
    models = httpx.get(f"{tandem_stack.base_url}/models").json()["data"]
    assert [m["id"] for m in models] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert httpx.get(f"{tandem_stack.http_url}/health").json()["status"] == "ok"


def test_client_disconnect_aborts_the_request_in_decode(tandem_stack):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{tandem_stack.base_url}/chat/completions", json={
                "model": tandem_stack.model, "messages": CHATS[0], "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leave mid-stream
    assert tandem_stack.running_after("decode") == 0, "the abandoned request still runs in decode"
    assert tandem_stack.metric("router", "tandem:router_requests_total", status="499") >= 1


def test_client_that_leaves_during_prefill_stops_the_request_there(tandem_stack):
    """A long prompt is still in prefill when the client hangs up: the router
    cancels the Prefill call (the engine aborts the request, or drops the reply
    of a step already under way), prefill frees its blocks, and decode never
    sees the request."""
    import json as _json
    import socket

    m = tandem_stack.metric
    routed_before = m("router", "tandem:router_routing_decisions_total", target_role="prefill")
    decode_before = m("router", "tandem:router_routing_decisions_total", target_role="decode")
    cancelled_before = m("router", "tandem:router_requests_total", status="499")
    computed_before = m("prefill-0", "tandem:prompt_tokens_by_source_total", source="local_compute")
    body = _json.dumps({"model": tandem_stack.model, "max_tokens": 4, "stream": True,
                        "messages": [{"role": "user", "content": "word " * 1500}]}).encode()
    host, port = tandem_stack.state["http_address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while (m("router", "tandem:router_routing_decisions_total", target_role="prefill") == routed_before
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert m("router", "tandem:router_routing_decisions_total", target_role="prefill") == routed_before + 1
    # Leaving the `with` hung up. Wait until prefill has been through the prompt.
    deadline = time.monotonic() + 60
    while (m("prefill-0", "tandem:prompt_tokens_by_source_total", source="local_compute") < computed_before + 1500
           and time.monotonic() < deadline):
        time.sleep(0.5)
    time.sleep(1.0)  # one more metrics poll
    assert m("prefill-0", "tandem:num_requests_running") == 0
    assert m("prefill-0", "tandem:kv_cache_free_blocks") == m("prefill-0", "tandem:kv_cache_total_blocks")
    assert m("router", "tandem:router_routing_decisions_total", target_role="decode") == decode_before
    assert m("router", "tandem:router_requests_total", status="499") == cancelled_before + 1
