"""Tensor parallelism of its own per role: a TP=2 prefill hands its prompts'
KV to a TP=1 decode through the KV store, a TP=1 prefill to a TP=2 decode,
and a TP=2 prefill to a TP=2 decode by the direct transfer (shared memory),
and the text is LLM.generate's; also with an FP8 KV cache (--kv-cache-dtype
fp8), whose blocks the ranks gather and the store carries as e4m3 bytes.
Real `tandem up` stacks (`--prefill-
tensor-parallel-size`, `--decode-tensor-parallel-size`) on a tiny random
Llama with 8 heads and 4 KV heads (SmolLM2's 9 heads do not split in two)
that carries SmolLM2's tokenizer, so the router can serve it."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.support.hf_oracle import tiny_model_dir
from tests.support.stack import StackOptions, TandemStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BLOCK = 16
MAX_TOKENS = 8
PROMPT_LENGTHS = (40, 75, 100)  # above the prefill threshold (32): each goes through the prefill tier
METRICS_POLL_S = 1.5  # engines publish their counters every 0.5 s


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tandem.engine import LLM, SamplingParams
    from tandem.engine.loader import load_model_info

    # A steep LM head: the greedy choice stands far above the runner-up, so the
    # last bits that differ between one rank's and two ranks' sums never flip it.
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("tp-roles"), "llama", vocab_size=49152,
                             num_attention_heads=8, num_key_value_heads=4, lm_head_scale=8.0)
    load_model_info("smollm2").tokenizer.save_pretrained(path)
    rng = random.Random(19)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in PROMPT_LENGTHS]
    texts = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(path, num_blocks=64, kv_cache_dtype=kv_dtype)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        llm.shutdown()
        texts[kv_dtype] = [o.outputs[0].text for o in outputs]
    return {"path": path, "prompts": prompts, "texts": texts}


@pytest.mark.parametrize("prefill_tp,decode_tp,transfer,slots,kv_dtype",
                         [(2, 1, "store", "on", "auto"), (1, 2, "store", "off", "auto"),
                          (2, 2, "direct", "off", "auto"), (2, 1, "store", "off", "fp8")],
                         ids=["prefill-tp2-decode-tp1-lent-slots", "prefill-tp1-decode-tp2", "direct-tp2-to-tp2",
                              "prefill-tp2-decode-tp1-fp8-kv-cache"])
def test_a_prefill_hands_kv_to_a_decode_of_another_tensor_parallel_size(model, prefill_tp, decode_tp, transfer,
                                                                        slots, kv_dtype):
    """direct: the decode copies each block's heads out of both prefill
    ranks' shared caches and hands its own rank 1 its half (both sides'
    tensor-parallel paths of the direct transfer in one stack). The first
    store case moves blocks through the store's lent slots, the second
    through the staging arena."""
    stack = TandemStack(StackOptions(private=True, extra_args=(
        "--model", model["path"], "--num-blocks", "64", "--kv-transfer", transfer, "--kv-store-slots", slots,
        "--kv-cache-dtype", kv_dtype,
        "--prefill-tensor-parallel-size", str(prefill_tp), "--decode-tensor-parallel-size", str(decode_tp))))
    try:
        stack.start()
        for name, size in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
            with open(stack.child(name)["log_path"], errors="replace") as f:
                log = f.read()
            assert (f"tensor parallelism: {size} ranks" in log) == (size > 1), name
            cache = "torch.float8_e4m3fn" if kv_dtype == "fp8" else "torch.float32"  # the engine's start line
            assert f"KV blocks of {BLOCK} tokens ({cache})" in log, name
        for prompt, expected in zip(model["prompts"], model["texts"][kv_dtype]):
            r = httpx.post(f"{stack.base_url}/completions", timeout=120, json={
                "model": stack.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
        # Every full prompt block was saved by the prefill and loaded by the decode.
        time.sleep(METRICS_POLL_S)
        full_blocks = sum((n - 1) // BLOCK for n in PROMPT_LENGTHS)
        assert stack.metric("decode-0", "tandem:prompt_tokens_by_source_total",
                            source="external_kv_transfer") == full_blocks * BLOCK
        assert stack.metric("decode-0", "tandem:kv_recompute_fallbacks_total") == 0
        assert stack.metric("decode-0", "tandem:kv_store_lent_blocks_total", direction="load") == (
            full_blocks if slots == "on" else 0)
    finally:
        stack.stop()
