"""The router against heavy and hostile clients. On the shared stack (`tandem
up`, 1 prefill + 1 decode): a 4 MB prompt is tokenized off the event loop,
so another stream keeps its pace (a solo test: alone, after the lanes); n=2
with the largest seed works over HTTP and gRPC; a request for 20k
completions is a 400 naming the field; a client that hangs up costs one log
line and no traceback. A private router process in front of the shared
engines: slow bodies hold no in-flight slot and get a 408. A router in
process in front of engines whose gRPC servers shed calls: an overload is
answered 429 with Retry-After, never 502."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections import Counter

import grpc
import httpx
import pytest

from tandem.services.common.grpc_server import make_channel
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
INT64_MAX = 2**63 - 1


def chat(**overrides) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 4}
    body.update(overrides)
    return body


# solo: the gaps it times are the stack's with CPUs to spare. Beside the unit
# lane on a 2-core machine the worker-process design's gaps reached 319-408
# ms in three full runs (2026-12-02 and 03), over the limit that tells it from
# the thread design; alone it measured 60-110 ms.
@pytest.mark.solo
def test_a_4mb_prompt_being_tokenized_does_not_stall_another_stream(tandem_stack):
    # Encoded up front: json.dumps of 4 MB holds this process's GIL, which
    # would stall the loop that times the stream.
    big = json.dumps({"model": MODEL, "prompt": "word " * 800_000, "max_tokens": 1}).encode()
    assert len(big) < 4 * 1024 * 1024  # under --max-body-bytes: it is tokenized, not refused
    marks: list[float] = []
    window: dict = {}

    def send_big() -> None:
        start = time.monotonic()
        r = httpx.post(f"{tandem_stack.base_url}/completions", content=big, timeout=120,
                       headers={"content-type": "application/json"})
        window.update(start=start, end=time.monotonic(), status=r.status_code, body=r.json())

    async def run() -> None:
        sender = None
        async with httpx.AsyncClient(timeout=120) as c:
            # logprobs: one chunk per token, so every gap is one decode step
            # (without them a token with no new text sends no chunk).
            # Long enough to outlast the big prompt on a busy machine (it took
            # over 14 s beside the suite's other lane); left once it is through.
            body = chat(max_tokens=2000, ignore_eos=True, temperature=0, logprobs=True, stream=True)
            async with c.stream("POST", f"{tandem_stack.base_url}/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        marks.append(time.monotonic())
                        if len(marks) == 5:  # streaming at its pace: now the big body
                            sender = asyncio.create_task(asyncio.to_thread(send_big))
                        if "end" in window and marks[-1] > window["end"]:
                            break
        await sender

    asyncio.run(run())
    assert window["status"] == 400, window["body"]
    assert window["body"]["error"]["code"] == "context_length_exceeded"
    assert window["end"] - window["start"] > 0.5, "too quick to tell: was it tokenized at all?"
    # Every gap that overlaps the time the big prompt was in the router.
    gaps = [b - a for a, b in zip(marks, marks[1:]) if b >= window["start"] and a <= window["end"]]
    assert gaps and marks[-1] > window["end"], "the stream ended before the big prompt was through"
    # The limit tells the designs apart with room for a busy 2-core machine:
    # tokenizing on the event loop stalled this stream 2.5-3 s, in a thread
    # 340-520 ms, in a worker process 60-110 ms (services/router/prompts.py),
    # and once 200 ms in a whole `make test` run on the dev machine
    # (2026-11-26, the prompt taking 15.3 s: the host busier than usual),
    # once 254 ms (2026-12-02, 16.5 s; the other gaps of that run 80-155 ms).
    # 300 ms still fails the thread design's 340 ms and more.
    assert max(gaps) < 0.300, (f"a gap of {max(gaps) * 1000:.0f} ms while the 4 MB prompt was "
                               f"tokenized ({window['end'] - window['start']:.1f} s)")


def test_n2_with_the_largest_seed_answers_over_http_and_grpc(tandem_stack):
    r = httpx.post(f"{tandem_stack.base_url}/chat/completions", timeout=120,
                   json=chat(n=2, seed=INT64_MAX, temperature=1.0))
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"])

    channel = make_channel(tandem_stack.grpc_target)
    try:
        stub = generate_pb2_grpc.TandemServiceStub(channel)
        params = common_pb2.SamplingParams(n=2, seed=INT64_MAX, temperature=1.0, max_tokens=4)
        replies = list(stub.Generate(generate_pb2.GenerateRequest(prompt="Hello", params=params),
                                     timeout=120))
    finally:
        channel.close()
    assert sorted(r.index for r in replies if r.finish_reason) == [0, 1]


def test_20k_prompts_in_one_request_is_a_400_naming_prompt(tandem_stack):
    r = httpx.post(f"{tandem_stack.base_url}/completions", timeout=60,
                   json={"model": MODEL, "prompt": ["hi"] * 20_000, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "split" in r.json()["error"]["message"]


def test_a_client_that_hangs_up_costs_one_log_line_and_no_traceback(tandem_stack):
    log_path = tandem_stack.child("router")["log_path"]
    offset = os.path.getsize(log_path)
    gone = lambda: tandem_stack.metric("router", "tandem:router_requests_total", status="499")  # noqa: E731
    before = gone()
    body = chat(max_tokens=2000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):  # not streaming: hangs up while the router collects
        httpx.post(f"{tandem_stack.base_url}/chat/completions", json=body, timeout=2)
    with httpx.Client(timeout=60) as http:  # streaming: hangs up mid-stream
        with http.stream("POST", f"{tandem_stack.base_url}/chat/completions",
                         json={**body, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
    deadline = time.monotonic() + 20
    while gone() < before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone() == before + 2
    time.sleep(0.5)
    with open(log_path, errors="replace") as f:
        f.seek(offset)
        new = f.read()
    assert "Traceback" not in new and "Exception in ASGI" not in new, new
    assert len([line for line in new.splitlines() if "closed the connection" in line]) == 2, new


# --- slow bodies: a private router in front of the shared engines ----------------------

@pytest.fixture(scope="module")
def strict_router(tandem_stack, tmp_path_factory):
    """A router process with --max-in-flight 8 and a 3 s body timeout."""
    engines = {role: ",".join(c["address"] for c in tandem_stack.children if c["role"] == role)
               for role in ("prefill", "decode")}
    log_path = tmp_path_factory.mktemp("strict-router") / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.services.router.server", "--port", "0", "--grpc-port", "-1",
             "--prefill", engines["prefill"], "--decode", engines["decode"], "--max-in-flight", "8",
             "--body-read-timeout", "3", "--tokenizer-workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"^router listening on (\S+)$", log_path.read_text(), re.M)):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(30)


def test_slow_bodies_hold_no_in_flight_slot_and_get_a_408(strict_router):
    host, port = strict_router.rsplit(":", 1)
    slow = []
    for _ in range(8):  # as many as --max-in-flight: each sends its head and a tenth of its body
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"model": "' + b" " * 90)
        slow.append(s)
    try:
        time.sleep(0.5)  # every head is in
        r = httpx.post(f"http://{strict_router}/v1/chat/completions", json=chat(max_tokens=2),
                       timeout=60)
        assert r.status_code == 200, r.text
        for s in slow:  # --body-read-timeout later: a 408, and the connection is closed
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
            assert b"--body-read-timeout" in reply
    finally:
        for s in slow:
            s.close()


# --- overload: engines whose gRPC servers shed calls ------------------------------------

class _Prefill:
    async def Prefill(self, request, context):
        await asyncio.sleep(0.01)
        from tandem.v1 import prefill_pb2

        return prefill_pb2.PrefillResponse(first_token_id=42,
                                           num_prompt_tokens=len(request.prompt_token_ids))

    async def GetLoad(self, request, context):
        return common_pb2.Load()


class _Decode:
    async def Decode(self, request, context):
        from tandem.v1 import decode_pb2

        await asyncio.sleep(0.01)
        yield decode_pb2.DecodeResponse(
            token_ids=list(request.first_token_ids) or [42], text="x", finish_reason="length",
            num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1)

    async def GetLoad(self, request, context):
        return common_pb2.Load()


async def _shedding_engine(role: str) -> tuple[grpc.aio.Server, str]:
    """A fake engine whose gRPC server keeps at most 64 calls waiting for its
    servicer (a real one: 1000, grpc.server.max_pending_requests) and cancels
    the rest, as a real one does under a burst bigger than that."""
    from grpc_health.v1 import health, health_pb2_grpc

    from tandem.v1 import decode_pb2_grpc, prefill_pb2_grpc

    server = grpc.aio.server(options=[("grpc.server.max_pending_requests", 64),
                                      ("grpc.server.max_pending_requests_hard_limit", 128)])
    if role == "prefill":
        servicer = type("FakePrefill", (_Prefill, prefill_pb2_grpc.PrefillServiceServicer), {})()
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    else:
        servicer = type("FakeDecode", (_Decode, decode_pb2_grpc.DecodeServiceServicer), {})()
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_an_overload_is_answered_429_with_retry_after_never_502():
    from tandem.engine.loader import load_model_info
    from tandem.services.router.app import GatewayConfig, create_app
    from tandem.services.router.backends import BackendPool
    from tandem.services.router.dispatch import Dispatcher
    from tandem.services.router.frontend import Frontend, ServedModel
    from tandem.services.router.policies import make_policy
    from tandem.services.router.prompts import PromptPool
    from tandem.services.router.server import _Uvicorn
    from tandem.services.router.telemetry import RouterTelemetry
    from tandem.v1 import decode_pb2_grpc, prefill_pb2_grpc

    info = load_model_info("smollm2")
    served = ServedModel(model_id=info.model_id, max_model_len=info.max_model_len, tokenizer=info.tokenizer)
    prompts = PromptPool(served.tokenizer, served.max_model_len, workers=1)

    async def run() -> list[tuple[int, str, str]]:
        engines = [await _shedding_engine("prefill"), await _shedding_engine("decode")]
        prefill = BackendPool("prefill", [engines[0][1]], prefill_pb2_grpc.PrefillServiceStub)
        decode = BackendPool("decode", [engines[1][1]], decode_pb2_grpc.DecodeServiceStub)
        await prefill.check_all()
        await decode.check_all()
        telemetry = RouterTelemetry(served.model_id)
        dispatcher = Dispatcher(prefill, decode, make_policy("round_robin"), make_policy("round_robin"),
                                1, telemetry)  # threshold 1: every prompt goes through prefill
        app = create_app(Frontend(served, dispatcher, prompts), telemetry,
                         {"prefill": prefill, "decode": decode}, GatewayConfig())
        http = _Uvicorn(app, "127.0.0.1", 0, 5.0)
        task, port = await http.start()

        async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str, str]:
            r = await c.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                             json=chat(n=16, max_tokens=2, messages=[{"role": "user", "content": f"q{i}"}]))
            message = r.json()["error"]["message"] if r.status_code != 200 else ""
            return r.status_code, r.headers.get("retry-after", ""), message

        try:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as c:
                return await asyncio.gather(*(one(c, i) for i in range(100)))
        finally:
            http.server.should_exit = True
            await task
            await prefill.close()
            await decode.close()
            for server, _ in engines:
                await server.stop(0)

    try:
        results = asyncio.run(run())
    finally:
        prompts.close()
    statuses = Counter(status for status, _, _ in results)
    assert set(statuses) <= {200, 429}, [r for r in results if r[0] not in (200, 429)][:3]
    # A shed call is a full instance: the router tries the next one, and with
    # every one full the request gets the decode tier's 429.
    assert statuses[429] >= 1, "nothing was refused: the test did not overload anything"
    assert all(retry == "1" for status, retry, _ in results if status == 429)
