"""Engines that copy blocks straight into the KV store's own memory (lent
slots, --kv-store-slots on) survive the store's death and restart: a real
stack whose store is killed and started again on its port. While it is gone
requests are answered by recomputing; once it is back the engines find its
new slabs (another token: the old ones are retired, never used again) and
the blocks go through lent slots again."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.support.stack import StackOptions, TandemStack, owned_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BLOCK = 16
POLL_S = 1.5  # engine metrics are polled every 0.5 s


@pytest.fixture(scope="module")
def stack():
    yield from owned_stack(StackOptions(prefill=1, decode=1, private=True,
                                        extra_args=("--num-blocks", "300", "--kv-store-slots", "on")))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(6 * BLOCK + 5)]


def complete(stack: TandemStack, tokens: list[int]) -> dict:
    r = httpx.post(f"{stack.base_url}/completions", timeout=120, json={
        "model": stack.model, "prompt": tokens, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def lent(stack: TandemStack) -> tuple[float, float]:
    time.sleep(POLL_S)
    return (stack.metric("prefill-0", "tandem:kv_store_lent_blocks_total", direction="save"),
            stack.metric("decode-0", "tandem:kv_store_lent_blocks_total", direction="load"))


def test_lent_slots_survive_the_stores_death_and_restart(stack):
    complete(stack, prompt(1))
    assert lent(stack) == (6, 6)
    stack.kill("kvstore")
    gone = complete(stack, prompt(2))  # the store is gone: recomputed, never an error
    assert gone["finish_reason"] == "length"
    stack.restart("kvstore")
    complete(stack, prompt(3))  # may still meet a connection to the old store, and recompute
    before = lent(stack)
    third = complete(stack, prompt(4))
    assert third["finish_reason"] == "length"
    after = lent(stack)
    assert (after[0] - before[0], after[1] - before[1]) == (6, 6)  # the new store's slots, both ways
    assert stack.metric("decode-0", "tandem:prompt_tokens_by_source_total",
                        source="external_kv_transfer") >= 2 * 6 * BLOCK
