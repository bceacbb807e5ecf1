"""Load with faults on a real stack (Redis store, 1 prefill, 2 decode): 200
concurrent streaming chat clients for 60 s while a decode instance is killed
and Redis is restarted. Every request completes or ends with a clear error
(a 429/503 with an OpenAI error body, or an error event in the stream), and
afterwards every surviving engine holds no KV block. Then SIGTERM drains the
router and a decode instance: in-flight streams finish, new work is refused.

The roles talk mTLS to each other (`tandem up --tls-cert/--tls-key/--tls-ca`),
so the load runs over the encrypted path a cluster would use."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import httpx
import pytest

from tandem.services.common.grpc_server import TLSConfig, make_channel
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.support.redis_server import RedisServer
from tests.support.stack import StackOptions, TandemStack
from tests.support.tls import make_certs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CLIENTS = 200
DURATION_S = 60.0
KILL_DECODE_AT_S = 15.0
RESTART_REDIS_AT_S = 30.0
MAX_TOKENS = 6
# Small engines so the queues fill: 32 running + 32 queued per instance, 128
# for two decodes against 200 clients (and 64 once one is dead).
ENGINE_FLAGS = ("--num-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "32",
                "--max-queued-requests", "32", "--routing", "least_loaded")
TOPICS = ["rain", "the moon", "bread", "a river", "music", "snow", "a bridge", "tea", "salt", "wind"]


@pytest.fixture(scope="module")
def redis():
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(str(tmp_path_factory.mktemp("certs")))


@pytest.fixture(scope="module")
def stack(redis, certs):
    tls = ("--tls-cert", certs.node_cert, "--tls-key", certs.node_key, "--tls-ca", certs.ca)
    stack = TandemStack(StackOptions(prefill=1, decode=2, store=redis.url,
                                     extra_args=ENGINE_FLAGS + tls, private=True))
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def engine_names(stack: TandemStack) -> list[str]:
    return [c["name"] for c in stack.children if c["role"] in ("prefill", "decode")]


def free_and_total(stack: TandemStack, name: str) -> tuple[float, float]:
    return (stack.metric(name, "tandem:kv_cache_free_blocks"),
            stack.metric(name, "tandem:kv_cache_total_blocks"))


@dataclass
class Outcome:
    kind: str  # ok | http_429 | http_503 | stream_error | FAILED:<why>
    started: float
    detail: str = ""


def messages(rng: random.Random) -> list[dict]:
    topic = rng.choice(TOPICS)
    if rng.random() < 0.5:  # long: through the prefill tier and the store
        return [{"role": "system", "content": "You answer in one short sentence, plainly. " * 3},
                {"role": "user", "content": f"What is {topic}? ({rng.randrange(10**6)})"}]
    return [{"role": "user", "content": f"{topic}?"}]


async def one_chat(http: httpx.AsyncClient, stack: TandemStack, rng: random.Random, t0: float) -> Outcome:
    started = time.monotonic() - t0
    body = {"model": stack.model, "messages": messages(rng), "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    try:
        async with http.stream("POST", f"{stack.base_url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                payload = json.loads(await r.aread())
                message = payload["error"]["message"]
                if r.status_code not in (429, 503) or not message:
                    return Outcome(f"FAILED:status {r.status_code}", started, message)
                if r.headers.get("retry-after") != "1":
                    return Outcome("FAILED:no Retry-After", started, message)
                return Outcome(f"http_{r.status_code}", started, message)
            finish, done = None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    if not event["error"]["message"]:
                        return Outcome("FAILED:empty error event", started)
                    return Outcome("stream_error", started, event["error"]["message"])
                for choice in event["choices"]:
                    finish = choice["finish_reason"] or finish
            if done and finish in ("stop", "length"):
                return Outcome("ok", started)
            return Outcome("FAILED:stream ended without [DONE] or an error", started)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Outcome(f"FAILED:{type(exc).__name__}", started, str(exc))


def test_200_streaming_clients_survive_a_dead_decode_and_a_redis_restart(stack, redis):
    start_blocks = {n: free_and_total(stack, n) for n in engine_names(stack)}
    assert all(free == total > 0 for free, total in start_blocks.values()), start_blocks
    outcomes: list[Outcome] = []

    async def client(i: int, http: httpx.AsyncClient, t0: float) -> None:
        rng = random.Random(i)
        await asyncio.sleep(rng.random() * 2)  # spread the first wave
        while time.monotonic() - t0 < DURATION_S:
            outcome = await one_chat(http, stack, rng, t0)
            outcomes.append(outcome)
            if outcome.kind.startswith("http_"):
                await asyncio.sleep(1.0)  # what Retry-After says

    async def faults(t0: float) -> None:
        await asyncio.sleep(KILL_DECODE_AT_S)
        await asyncio.to_thread(stack.kill, "decode-1")
        await asyncio.sleep(RESTART_REDIS_AT_S - KILL_DECODE_AT_S)
        await asyncio.to_thread(redis.restart)

    async def run() -> None:
        # Idle connections expire on the client first (the router keeps them 5 s),
        # so a request never races the server closing the connection it reuses.
        limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            t0 = time.monotonic()
            await asyncio.gather(faults(t0), *(client(i, http, t0) for i in range(CLIENTS)))

    asyncio.run(run())

    kinds = Counter(o.kind for o in outcomes)
    print(f"outcomes: {dict(kinds)}")  # shown with -rP
    print("stream errors:", Counter(o.detail.split(":")[0][:60] for o in outcomes if o.kind == "stream_error"))
    failed = [o for o in outcomes if o.kind.startswith("FAILED")]
    assert not failed, f"{kinds}; first failures: {failed[:5]}"
    assert kinds["ok"] >= CLIENTS // 2, kinds
    # Served after the kill and after the restart, not only before them.
    assert any(o.kind == "ok" and o.started > RESTART_REDIS_AT_S + 2 for o in outcomes), kinds
    # Streams on the killed decode ended with an error event that says so.
    cut = [o for o in outcomes if o.kind == "stream_error"]
    assert cut and all("decode" in o.detail for o in cut), (kinds, Counter(o.detail for o in cut))
    # Back-pressure: queues were full at times, and said so with 429 + Retry-After.
    assert kinds["http_429"] > 0, kinds
    assert sum(stack.metric(n, "tandem:requests_rejected_total") for n in ("prefill-0", "decode-0")) > 0
    assert stack.metric("router", "tandem:router_backend_failures_total", target_role="decode") >= 1
    # KV really went through the store over mTLS (a failing store would only show as recompute).
    assert stack.metric("kvstore", "tandem:kvstore_puts_total") > 0
    assert stack.metric("decode-0", "tandem:kv_transfer_blocks_total", direction="load") > 0

    health = httpx.get(f"{stack.http_url}/health", timeout=10).json()
    assert health["instances"]["decode"] == {"healthy": 1, "total": 2}
    survivors = [n for n in engine_names(stack) if n != "decode-1"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {n: free_and_total(stack, n) for n in survivors}
        if all(now[n] == start_blocks[n] for n in survivors):
            break
        time.sleep(0.5)
    assert now == {n: start_blocks[n] for n in survivors}, "a surviving engine still holds KV blocks"
    # The store is back after Redis restarted: a long prompt goes through prefill and the store again.
    r = httpx.post(f"{stack.base_url}/chat/completions", timeout=120, json={
        "model": stack.model, "messages": messages(random.Random(99))[:1] + [
            {"role": "user", "content": "And one more time?"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_a_dead_prefill_tier_means_decode_prefills(stack):
    skipped_before = stack.metric("router", "tandem:router_prefill_skipped_total")
    stack.kill("prefill-0")
    for i in range(2):  # the first may find it by its failed call, the second by health
        r = httpx.post(f"{stack.base_url}/chat/completions", timeout=120, json={
            "model": stack.model, "max_tokens": 3, "messages": [
                {"role": "system", "content": "You answer in one short sentence, plainly. " * 3},
                {"role": "user", "content": f"Say {i}."}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 32  # a prompt that would go through prefill
    assert stack.metric("router", "tandem:router_prefill_skipped_total") == skipped_before + 2


def _stream_tokens(stack: TandemStack, max_tokens: int, results: list, started: asyncio.Event):
    async def go():
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{stack.base_url}/chat/completions", json={
                    "model": stack.model, "messages": [{"role": "user", "content": "Count to fifty."}],
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()
                results.append(lines)
    return go()


def test_sigterm_drains_the_router(stack):
    router = stack.child("router")
    results: list[list[str]] = []

    async def run():
        started = asyncio.Event()
        streams = [asyncio.create_task(_stream_tokens(stack, 40, results, started)) for _ in range(3)]
        await started.wait()
        os.kill(router["pid"], signal.SIGTERM)
        await asyncio.sleep(1.0)
        # Draining: the listening socket is closed, new connections are refused.
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=5) as http:
                await http.get(f"{stack.http_url}/health")
        await asyncio.gather(*streams)

    asyncio.run(run())
    assert len(results) == 3
    for lines in results:
        assert lines[-1] == "[DONE]"
        finishes = [c["finish_reason"] for e in lines[:-1] for c in json.loads(e)["choices"]]
        assert finishes[-1] == "length"
    deadline = time.monotonic() + 30
    while _alive(router["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(router["pid"]), "the router did not exit after draining"


def test_roles_refuse_plaintext_and_clients_without_a_certificate(stack, certs):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def check(tls) -> None:
        channel = make_channel(stack.child("decode-0")["address"], tls)
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        finally:
            channel.close()

    check(TLSConfig(certs.node_cert, certs.node_key, certs.ca))  # the way the roles call it
    for tls in (None, TLSConfig(ca_file=certs.ca)):
        with pytest.raises(grpc.RpcError) as info:
            check(tls)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_drains_a_decode_instance(stack, certs):
    decode = stack.child("decode-0")
    channel = make_channel(decode["address"], TLSConfig(certs.node_cert, certs.node_key, certs.ca))
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    request = decode_pb2.DecodeRequest(
        request_id="drain-1", prompt_token_ids=list(range(1000, 1040)),
        params=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    try:
        replies = stub.Decode(request, timeout=120)
        first = next(replies)
        os.kill(decode["pid"], signal.SIGTERM)
        rest = list(replies)  # finishes although the instance is stopping
        assert sum(len(r.token_ids) for r in [first, *rest]) == 40
        assert rest[-1].finish_reason == "length"
        with pytest.raises(grpc.RpcError) as info:  # new work is refused while draining or after
            list(stub.Decode(decode_pb2.DecodeRequest(request_id="drain-2", prompt_token_ids=[1000, 1001],
                                                      params=common_pb2.SamplingParams(max_tokens=2)),
                             timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
    deadline = time.monotonic() + 30
    while _alive(decode["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(decode["pid"]), "decode did not exit after draining"


def _alive(pid: int) -> bool:
    from tests.support.stack import _alive as alive

    return alive(pid)
