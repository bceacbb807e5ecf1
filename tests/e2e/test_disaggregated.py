"""Disaggregated serving on a real stack, with both KV store backends: decode
computes only what prefill could not save, the store serves a shared prefix
across prefill instances, and the stack survives a store outage and a dead
decode instance."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.support.redis_server import RedisServer
from tests.support.stack import StackOptions, TandemStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 16  # `tandem up`'s default --block-size
POLL_S = 1.5  # engine metrics are polled every 0.5 s


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request):
    """Two prefill instances (round robin, so consecutive requests meet
    different ones) and, with the memory store, two decode instances."""
    redis = RedisServer().start() if request.param == "redis" else None
    store = redis.url if redis else "memory"
    options = StackOptions(prefill=2, decode=2 if request.param == "memory" else 1, store=store,
                           extra_args=("--routing", "round_robin"), private=True)
    stack = TandemStack(options)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        if redis:
            redis.close()


def names(stack: TandemStack, role: str) -> list[str]:
    return [c["name"] for c in stack.children if c["role"] == role]


def total(stack: TandemStack, role: str, metric: str, **labels) -> float:
    return sum(stack.metric(n, metric, **labels) for n in names(stack, role))


def by_source(stack: TandemStack, role: str) -> dict[str, float]:
    return {s: total(stack, role, "tandem:prompt_tokens_by_source_total", source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def token_prompt(seed: int, length: int) -> list[int]:
    """A prompt of token ids no other test uses (ordinary vocabulary range)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(length)]


def complete(stack: TandemStack, prompt: list[int], max_tokens: int = 4) -> dict:
    r = httpx.post(f"{stack.base_url}/completions", timeout=120, json={
        "model": stack.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_decode_computes_only_the_tail_prefill_could_not_save(stack):
    prompt = token_prompt(1, 6 * BLOCK + 5)  # 6 full blocks saved by prefill, 5 tokens left
    before = by_source(stack, "decode")
    out = complete(stack, prompt)
    time.sleep(POLL_S)
    after = by_source(stack, "decode")
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert after["local_compute"] - before["local_compute"] == 5
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == 6 * BLOCK
    assert total(stack, "decode", "tandem:kv_transfer_blocks_total", direction="load") > 0


def test_shared_prefix_is_served_from_the_store(stack):
    shared = token_prompt(2, 6 * BLOCK)
    first = shared + token_prompt(3, 20)
    second = shared + token_prompt(4, 20)
    complete(stack, first)  # prefill instance A computes the prefix and saves it
    time.sleep(POLL_S)
    before = by_source(stack, "prefill")
    out = complete(stack, second)  # round robin: instance B, whose local cache lacks it
    time.sleep(POLL_S)
    after = by_source(stack, "prefill")
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == 6 * BLOCK
    assert after["local_compute"] - before["local_compute"] == 20
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK
    assert stack.metric("kvstore", "tandem:kvstore_hits_total") > 0


def test_requests_survive_a_kvstore_outage(stack):
    baseline_prompt = token_prompt(5, 5 * BLOCK + 3)
    want = complete(stack, baseline_prompt, max_tokens=6)["choices"][0]["text"]
    stack.kill("kvstore")
    time.sleep(POLL_S)  # the baseline's own tokens must be counted before `before`
    before = by_source(stack, "decode")
    # A fresh prompt: the store lookup fails, so decode computes the whole prompt.
    fresh = token_prompt(6, 5 * BLOCK + 3)
    out = complete(stack, fresh, max_tokens=6)
    assert out["choices"][0]["finish_reason"] == "length"
    time.sleep(POLL_S)
    after = by_source(stack, "decode")
    assert after["local_compute"] - before["local_compute"] == len(fresh)
    assert after["external_kv_transfer"] == before["external_kv_transfer"]
    assert complete(stack, baseline_prompt, max_tokens=6)["choices"][0]["text"] == want


def test_new_requests_avoid_a_dead_decode_instance(stack):
    decodes = names(stack, "decode")
    if len(decodes) < 2:
        pytest.skip("this stack runs one decode instance (the memory-store stack runs two)")
    dead, alive = decodes[1], decodes[0]
    alive_address = stack.child(alive)["address"]
    stack.kill(dead)
    before = stack.metric("router", "tandem:router_routing_decisions_total", target_role="decode",
                          backend=alive_address)
    for i in range(4):
        out = complete(stack, token_prompt(10 + i, 40), max_tokens=3)
        assert out["choices"][0]["finish_reason"] == "length"
    after = stack.metric("router", "tandem:router_routing_decisions_total", target_role="decode",
                         backend=alive_address)
    assert after - before == 4
    health = httpx.get(f"{stack.http_url}/health").json()
    assert health["instances"]["decode"] == {"healthy": 1, "total": 2}
