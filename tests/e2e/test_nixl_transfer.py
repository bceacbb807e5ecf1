"""NIXL KV transfer on a real stack (`tandem up --kv-transfer nixl`): prefill
and decode are separate processes, no KV store runs, and the decode reads
each prompt's blocks out of the prefill's cache through NIXL (UCX), as it
would across hosts. Answers equal the offline engine's, decode computes only
the tail of each prompt, and the prefill gets every block back once the
router releases it."""
from __future__ import annotations

import random
import time

import httpx
import pytest

pytest.importorskip("tandem.engine.connector.nixl").nixl_api()  # skips without NIXL installed

from tandem.engine import LLM, SamplingParams  # noqa: E402
from tests.support.stack import StackOptions, tandem_stack  # noqa: E402,F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TANDEM_STACK_OPTIONS = StackOptions(prefill=1, decode=1, extra_args=("--kv-transfer", "nixl"))
BLOCK = 16
POLL_S = 1.5  # engine metrics are polled every 0.5 s


def prompt_tokens(stack, role: str, source: str) -> float:
    return stack.metric(f"{role}-0", "tandem:prompt_tokens_by_source_total", source=source)


def test_decode_reads_the_prompt_through_nixl_and_answers_as_the_offline_engine(tandem_stack):
    assert sorted(c["role"] for c in tandem_stack.children) == ["decode", "prefill", "router"]
    rng = random.Random(11)
    prompt = [rng.randrange(1000, 20000) for _ in range(6 * BLOCK + 5)]
    expected = LLM("smollm2").generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    external = prompt_tokens(tandem_stack, "decode", "external_kv_transfer")
    computed = prompt_tokens(tandem_stack, "decode", "local_compute")
    r = httpx.post(f"{tandem_stack.base_url}/completions", timeout=120, json={
        "model": tandem_stack.model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected.outputs[0].text
    time.sleep(POLL_S)
    assert prompt_tokens(tandem_stack, "decode", "external_kv_transfer") - external == 6 * BLOCK
    assert prompt_tokens(tandem_stack, "decode", "local_compute") - computed == 5
    assert tandem_stack.metric("decode-0", "tandem:kv_recompute_fallbacks_total") == 0
    # The router released the hold after decode's first message: nothing stays taken.
    deadline = time.monotonic() + 15
    while tandem_stack.metric("prefill-0", "tandem:kv_held_blocks") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tandem_stack.metric("prefill-0", "tandem:kv_held_blocks") == 0
