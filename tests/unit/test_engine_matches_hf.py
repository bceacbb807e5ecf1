"""Greedy output of the engine equals HF transformers `generate`, token for token
(fp32, CPU), for a batch of mixed-length prompts decoded together — plainly,
with small prefill chunks, with prefix caching on a shared prefix, and with so
few KV blocks that preemption happens (by recompute, and by swapping to the
host KV tier). Logprobs agree within 1e-4."""
from __future__ import annotations

import collections
import random
import time

import pytest

from tandem.engine import LLM, SamplingParams
from tandem.services.kvstore.block_client import BlockStoreClient
from tests.support.kvstore_process import start_store
from tests.support.hf_oracle import check_against_oracle, embedded_hf_model, hf_greedy, run_greedy, tiny_model_dir

MAX_NEW = 12
LENGTHS = [1, 5, 17, 33, 64, 150, 300, 600]

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how knowledge moved across Europe. Before it, books were copied by hand, slowly "
    "and at great cost. Scholars, merchants and clergy all felt the change within a generation. "
    "Cities with presses grew faster, and ideas that once took decades to spread now crossed "
    "borders in a few years. Meanwhile, mathematicians refined astronomy, sailors charted new "
    "coasts, and physicians argued about the circulation of blood. "
)


def run_engine(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW):
    return run_greedy(llm, prompts, max_new)


# ---- SmolLM2, the embedded model: every token must match -----------------

@pytest.fixture(scope="module")
def smol():
    hf, tokenizer = embedded_hf_model()
    ids = tokenizer(TEXT * 8)["input_ids"]
    rng = random.Random(0)
    prompts = []
    for n in LENGTHS:  # slices from different offsets: mixed content, mixed lengths
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start:start + n])
    refs = [hf_greedy(hf, p, MAX_NEW, eos_token_id=None) for p in prompts]
    return {"hf": hf, "prompts": prompts, "refs": refs, "tokenizer": tokenizer}


def test_smollm2_batch_matches_hf(smol):
    llm = LLM("smollm2")
    check_against_oracle(run_engine(llm, smol["prompts"]), smol["refs"], exact=True)


def test_smollm2_small_prefill_chunks_match_hf(smol):
    llm = LLM("smollm2", max_num_batched_tokens=48, long_prefill_token_threshold=32)
    check_against_oracle(run_engine(llm, smol["prompts"]), smol["refs"], exact=True)


def tokens_computed_per_request(llm: LLM) -> collections.Counter:
    """Counts, from every plan the engine runs from now on, the tokens each
    request computes (observed: the real scheduler plans)."""
    counts: collections.Counter = collections.Counter()
    schedule = llm.engine.scheduler.schedule

    def observed():
        plan = schedule()
        counts.update(dict(zip(plan.request_ids, plan.num_new_tokens)))
        return plan

    llm.engine.scheduler.schedule = observed
    return counts


# One KV block of SmolLM2 in fp32: 30 layers x K/V x 16 tokens x 3 heads x 64 x 4 bytes.
SMOL_BLOCK_GIB = 30 * 2 * 16 * 3 * 64 * 4 / 2**30


@pytest.mark.parametrize("swap_space", [0.0, 200 * SMOL_BLOCK_GIB], ids=["recompute", "swap"])
def test_smollm2_preemption_matches_hf(smol, swap_space):
    # 40 usable blocks: the 600-token prompt alone needs 39, all together ~90.
    # Greedy admission: reserving for the outputs (the default) would mostly
    # keep requests waiting instead of preempting them.
    llm = LLM("smollm2", num_blocks=41, swap_space=swap_space, admission="greedy")
    computed = tokens_computed_per_request(llm)
    outputs = run_engine(llm, smol["prompts"])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the test must force preemption"
    check_against_oracle(outputs, smol["refs"], exact=True)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks
    # Without recompute a request computes its tokens once, less what it found cached.
    once = {f"{o.request_id}#0": len(o.prompt_token_ids) + MAX_NEW - 1 - o.num_cached_tokens for o in outputs}
    recomputed = {rid for rid, n in computed.items() if n > once[rid]}
    if swap_space:
        assert stats.kv_swapped_out_blocks > 0 and stats.kv_swapped_in_blocks > 0
        assert not recomputed, "swapped requests resume where they stopped"
        assert all(c == 0 for c in llm.engine.swapper.tier.ref_cnt)
    else:
        assert recomputed, "by recompute, a preempted request computes some tokens twice"
        assert stats.kv_swapped_out_blocks == 0


def test_smollm2_heads_outer_blocks_match_hf_through_chunks_swaps_and_prefix_hits(smol):
    """--kv-cache-layout HND: each block stored heads-outer, seen through a
    transposed view. Small chunks, too few blocks (preempted requests swap to
    the host tier and back), then the same prompts again (prefix-cache hits
    on the blocks the first pass left)."""
    llm = LLM("smollm2", kv_cache_layout="HND", num_blocks=41, max_num_batched_tokens=48,
              long_prefill_token_threshold=32, admission="greedy", swap_space=200 * SMOL_BLOCK_GIB)
    cache = llm.engine.runner.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    assert cache.stride()[3:] == (64, 16 * 64, 1), "a KV head's 16 rows of a block lie side by side"
    check_against_oracle(run_engine(llm, smol["prompts"]), smol["refs"], exact=True)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_swapped_in_blocks > 0, "the test must force swapping"
    again = run_engine(llm, smol["prompts"])
    check_against_oracle(again, smol["refs"], exact=True)
    assert sum(o.num_cached_tokens for o in again) > 0, "the second pass must hit the prefix cache"


def test_smollm2_asynchronous_scheduling_matches_hf_through_chunks_and_preemption(smol):
    """Each step scheduled while the last one's tokens are still in flight
    (forced on here: on the CPU it only changes the order of the work), with
    small prefill chunks and too few blocks: preempted requests too."""
    llm = LLM("smollm2", async_scheduling="on", num_blocks=41, max_num_batched_tokens=48,
              long_prefill_token_threshold=32, admission="greedy")
    assert llm.engine.async_scheduling
    outputs = run_engine(llm, smol["prompts"])
    assert llm.engine.stats().num_preemptions > 0, "the test must force preemption"
    check_against_oracle(outputs, smol["refs"], exact=True)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


def test_smollm2_preemption_with_a_tier_too_small_recomputes_and_matches_hf(smol):
    llm = LLM("smollm2", num_blocks=41, swap_space=1.5 * SMOL_BLOCK_GIB, admission="greedy")  # one slot
    assert llm.engine.swapper.tier.num_slots == 1
    outputs = run_engine(llm, smol["prompts"])
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_swapped_out_blocks == 0
    check_against_oracle(outputs, smol["refs"], exact=True)


def test_smollm2_evicted_prefix_is_restored_from_the_host_tier(smol):
    tok = smol["tokenizer"]
    prefix = tok(TEXT)["input_ids"][:100]
    full_blocks = len(prefix) // 16
    first, second = prefix + tok(" Who built it?")["input_ids"], prefix + tok(" Name one city.")["input_ids"]
    refs = [hf_greedy(smol["hf"], p, 8, eos_token_id=None) for p in (first, second)]
    # 630 tokens and 1 more: all 40 device blocks, so no block of the first prompt stays cached.
    filler = tok(TEXT * 8)["input_ids"][50:680]
    cached = {}
    for swap_space in (0.0, 100 * SMOL_BLOCK_GIB):
        llm = LLM("smollm2", num_blocks=41, swap_space=swap_space)
        outputs = run_engine(llm, [first], 8) + run_engine(llm, [filler], 1) + run_engine(llm, [second], 8)
        check_against_oracle([outputs[0], outputs[2]], refs, exact=True)
        cached[swap_space] = outputs[2].num_cached_tokens
    stats = llm.engine.stats()
    assert cached[0.0] == 0, "without the tier the device cache has lost the prefix"
    assert cached[100 * SMOL_BLOCK_GIB] == full_blocks * 16, "with it the prefix is swapped in, not computed"
    assert stats.kv_host_offloaded_blocks >= full_blocks and stats.kv_host_hit_blocks == full_blocks


@pytest.fixture(scope="module")
def kv_store():
    store = start_store("--backend", "memory", "--capacity", "256MiB")
    yield store
    store.stop()


def store_backed(store, **kwargs) -> LLM:
    """SmolLM2 whose connector saves to and loads from a real KV store process."""
    return LLM("smollm2", kv_transfer="store", kv_role="both",
               kv_store=BlockStoreClient(store.target, timeout_s=10.0), **kwargs)


def lookups_before_admission(llm: LLM, monkeypatch) -> None:
    """Each request's store lookup ends before it can be admitted. Otherwise
    the long prompts, which look up, wait while the short ones, which have
    no full block to look up, run: on a busy machine the short ones could
    finish first and nothing would ever be preempted (it happened in CI)."""
    connector = llm.engine.connector
    prefetch = connector.prefetch

    def prefetch_and_wait(request, num_local_hit_tokens: int) -> None:
        prefetch(request, num_local_hit_tokens)
        while not connector.is_ready(request):
            time.sleep(0.005)

    monkeypatch.setattr(connector, "prefetch", prefetch_and_wait)


def test_smollm2_preemption_swaps_to_the_host_tier_beside_the_kv_store(smol, kv_store, monkeypatch):
    llm = store_backed(kv_store, num_blocks=41, swap_space=200 * SMOL_BLOCK_GIB, admission="greedy")
    lookups_before_admission(llm, monkeypatch)
    outputs = run_engine(llm, smol["prompts"])
    check_against_oracle(outputs, smol["refs"], exact=True)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_swapped_out_blocks > 0 and stats.kv_swapped_in_blocks > 0
    assert stats.kv_save_blocks > 0 and stats.recompute_fallbacks == 0
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks
    llm.engine.shutdown()


def test_smollm2_tiers_go_device_then_host_then_the_kv_store(smol, kv_store):
    tok = smol["tokenizer"]
    prefix = tok("Tiers. " + TEXT)["input_ids"][:100]  # not a prefix any earlier test stored
    full_blocks = len(prefix) // 16
    first, second = prefix + tok(" Who built it?")["input_ids"], prefix + tok(" Name one city.")["input_ids"]
    refs = [hf_greedy(smol["hf"], p, 8, eos_token_id=None) for p in (first, second)]
    filler = tok(TEXT * 8)["input_ids"][50:680]  # takes every device block: the prefix leaves the device
    # An engine with a host tier: the evicted prefix comes back from the host, not the store.
    tiered = store_backed(kv_store, num_blocks=41, swap_space=100 * SMOL_BLOCK_GIB)
    outputs = run_engine(tiered, [first], 8) + run_engine(tiered, [filler], 1) + run_engine(tiered, [second], 8)
    check_against_oracle([outputs[0], outputs[2]], refs, exact=True)
    stats = tiered.engine.stats()
    assert outputs[2].num_cached_tokens == full_blocks * 16 and stats.kv_host_hit_blocks == full_blocks
    assert stats.prompt_tokens_external == 0, "the store must not supply what the host tier restored"
    tiered.engine.shutdown()
    # A fresh engine (empty device and host): the same prefix comes from the store.
    fresh = store_backed(kv_store, num_blocks=41, swap_space=100 * SMOL_BLOCK_GIB)
    again = run_engine(fresh, [second], 8)
    check_against_oracle(again, refs[1:], exact=True)
    stats = fresh.engine.stats()
    assert stats.prompt_tokens_external == full_blocks * 16 and stats.kv_host_hit_blocks == 0
    fresh.engine.shutdown()


def test_smollm2_engines_of_both_block_layouts_share_blocks_through_the_kv_store(smol, kv_store):
    """The store connector copies blocks by indexing the cache, so what a
    heads-outer engine saves a tokens-outer one loads, and back."""
    tok = smol["tokenizer"]
    for i, (saver_layout, loader_layout) in enumerate((("HND", "NHD"), ("NHD", "HND"))):
        prompt = tok(f"Layouts {i}. " + TEXT)["input_ids"][:100]  # a prefix no other test stored
        full_blocks = len(prompt) // 16
        ref = hf_greedy(smol["hf"], prompt, 8, eos_token_id=None)
        saver = store_backed(kv_store, kv_cache_layout=saver_layout)
        check_against_oracle(run_engine(saver, [prompt], 8), [ref], exact=True)
        assert saver.engine.stats().kv_save_blocks >= full_blocks
        saver.engine.shutdown()
        loader = store_backed(kv_store, kv_cache_layout=loader_layout)
        check_against_oracle(run_engine(loader, [prompt], 8), [ref], exact=True)
        assert loader.engine.stats().prompt_tokens_external == full_blocks * 16, (saver_layout, loader_layout)
        loader.engine.shutdown()


def test_smollm2_shared_prefix_hits_cache_and_matches_hf(smol):
    tok = smol["tokenizer"]
    prefix = tok(TEXT)["input_ids"][:100]
    suffixes = ["Summarize this.", "Who built it?", "Name one city.", "Why did it matter?",
                "List two effects.", "What came before?", "Translate to French.", "Is it true?"]
    prompts = [prefix + tok(" " + s)["input_ids"] for s in suffixes]
    refs = [hf_greedy(smol["hf"], p, 8, eos_token_id=None) for p in prompts]
    llm = LLM("smollm2")
    first = run_engine(llm, prompts[:1], 8)  # computes the prefix once
    rest = run_engine(llm, prompts[1:], 8)  # all of these reuse it
    check_against_oracle(first + rest, refs, exact=True)
    full_blocks = len(prefix) // 16
    assert all(o.num_cached_tokens == full_blocks * 16 for o in rest)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 7 * full_blocks * 16


def test_smollm2_chat_answers_paris():
    llm = LLM("smollm2")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


# ---- tiny random-weight models: near ties may flip, and only there ---------

@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path, hf = tiny_model_dir(tmp_path_factory.mktemp("models"), request.param)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    refs = [hf_greedy(hf, p, 16, eos_token_id=None) for p in prompts]
    return {"path": path, "prompts": prompts, "refs": refs}


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 40, "long_prefill_token_threshold": 24},
    {"num_blocks": 41, "admission": "greedy"},  # greedy: preemption happens
    {"num_blocks": 41, "swap_space": 0.01, "admission": "greedy"},
    {"policy": "srtf"},
], ids=["plain", "chunked", "preempt", "preempt-swap", "srtf"])
def test_tiny_models_match_hf(tiny, options):
    llm = LLM(tiny["path"], **options)
    outputs = run_engine(llm, tiny["prompts"], 16)
    if "num_blocks" in options:
        assert llm.engine.stats().num_preemptions > 0
    if "swap_space" in options:
        assert llm.engine.stats().kv_swapped_out_blocks > 0
    check_against_oracle(outputs, tiny["refs"], exact=False)
