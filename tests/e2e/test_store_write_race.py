"""The prefill answers once its blocks are staged, before the store has them,
and the decode that asks too early waits for them instead of reading half a
block or recomputing: a real stack whose KV store delays every put
(TANDEM_KVSTORE_PUT_DELAY_S, a fault hook), with the router carrying the
prefill's KVStoreWrite to the decode. Both ways blocks reach the store: through
the engines' staging arenas, and straight into the store's own slots
(--kv-store-slots on), where the delay holds the commit that makes them
visible."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.support.stack import StackOptions, TandemStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BLOCK = 16
PUT_DELAY_S = 1.5
POLL_S = 1.5  # engine metrics are polled every 0.5 s


@pytest.fixture(scope="module", params=["off", "on"], ids=["arena", "lent-slots"])
def stack(request):
    options = StackOptions(prefill=1, decode=1, private=True,
                           extra_args=("--num-blocks", "300", "--kv-store-slots", request.param),
                           env=(("TANDEM_FAULT_HOOKS", "1"), ("TANDEM_KVSTORE_PUT_DELAY_S", str(PUT_DELAY_S))))
    stack = TandemStack(options)
    stack.lends_slots = request.param == "on"
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def completion(stack: TandemStack, prompt: list[int]) -> str:
    r = httpx.post(f"{stack.base_url}/completions", timeout=120, json={
        "model": stack.model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_decode_waits_for_the_blocks_its_prefill_is_still_writing(stack):
    rng = random.Random(41)
    prompt = [rng.randrange(1000, 20000) for _ in range(6 * BLOCK + 5)]
    text = completion(stack, prompt)
    time.sleep(POLL_S)
    # The prefill answered while its put sat in the store's delay...
    prefill_seconds = stack.metric("prefill-0", "tandem:e2e_request_latency_seconds_sum")
    assert 0 < prefill_seconds < PUT_DELAY_S
    # ...and the decode waited for it, then loaded every full block.
    assert stack.metric("decode-0", "tandem:kv_store_write_wait_seconds_total") > PUT_DELAY_S / 2
    assert stack.metric("decode-0", "tandem:kv_store_write_wait_timeouts_total") == 0
    assert stack.metric("decode-0", "tandem:prompt_tokens_by_source_total",
                        source="external_kv_transfer") == 6 * BLOCK
    assert stack.metric("decode-0", "tandem:prompt_tokens_by_source_total", source="local_compute") == 5
    lent = 6 if stack.lends_slots else 0  # every full block, or none
    assert stack.metric("prefill-0", "tandem:kv_store_lent_blocks_total", direction="save") == lent
    assert stack.metric("decode-0", "tandem:kv_store_lent_blocks_total", direction="load") == lent
    # The same prompt again: the decode's own prefix cache answers; the text is the same.
    assert completion(stack, prompt) == text
