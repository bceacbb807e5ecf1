"""The direct KV transfer at engine level (CPU, shared memory): a decode
engine copies a prefill engine's blocks out of its shared cache and answers
exactly as an engine that computed the whole prompt; a block no longer held
when it is copied, an unreachable cache or another model's cache fall back to
computing; holds end on release or timeout and no block leaks.

Both engines run in this process here (the shared-memory segment is opened by
name all the same); tests/e2e/test_direct_transfer.py runs them as separate
services, and tests/gpu/test_kv_pull_gpu.py over CUDA IPC."""
from __future__ import annotations

import dataclasses

import pytest

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
from tandem.engine.connector.direct import HANDLE_KEY
from tandem.engine.llm_engine import LLMEngine
from tests.support.hf_oracle import tiny_model_dir

BLOCK = 16
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(75)]  # 4 full blocks and 11 tokens
OTHER = [(11 * i + 5) % 500 + 2 for i in range(120)]
MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("direct"), "llama")
    return path


def engine(model_dir: str, connector=None, role="both", num_blocks=64, hold_timeout_s=30.0) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                                  device="cpu", kv_transfer=connector, kv_role=role,
                                  kv_hold_timeout_s=hold_timeout_s))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(eng: LLMEngine, rid: str, prompt, max_tokens: int, **kwargs):
    eng.add_request(rid, prompt, greedy(max_tokens), **kwargs)
    tokens, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                last = out
    return tokens, last


@pytest.fixture(scope="module")
def reference(model_dir):
    tokens, _ = run(engine(model_dir), "ref", PROMPT, MAX_NEW)
    return tokens


@pytest.fixture
def prefill(model_dir):
    eng = engine(model_dir, "direct", "producer", num_blocks=12)
    yield eng
    eng.shutdown()


def decode_after(prefill_engine: LLMEngine, decode_engine: LLMEngine, prompt=PROMPT, release_first=False):
    first, out = run(prefill_engine, "r1", prompt, 1)
    params = out.kv_transfer_params
    if release_first:
        assert prefill_engine.release_kv("r1")
    tokens, _ = run(decode_engine, "r1", prompt, MAX_NEW, first_token_ids=first, kv_transfer_params=params)
    assert tokens[:1] == first, "decode's first output carries the token prefill sampled"
    return tokens, params


def test_decode_copies_the_prefills_blocks_and_answers_the_same(model_dir, prefill, reference):
    free_at_start = prefill.kv.pool.num_free_blocks
    decode = engine(model_dir, "direct", "consumer")
    tokens, params = decode_after(prefill, decode)
    assert tokens == reference
    handle = params[HANDLE_KEY]
    assert len(handle.block_ids) == len(PROMPT) // BLOCK
    stats = decode.stats()
    assert stats.kv_load_blocks == 4 and stats.recompute_fallbacks == 0
    assert stats.prompt_tokens_external == 4 * BLOCK
    assert stats.prompt_tokens_computed == len(PROMPT) - 4 * BLOCK  # only the tail
    # The prefill holds the blocks until released; then every block is free again.
    assert prefill.scheduler.num_held_blocks == prefill.stats().num_held_blocks == 4
    assert prefill.release_kv("r1") and not prefill.release_kv("r1")
    assert prefill.kv.pool.num_free_blocks == free_at_start
    assert decode.kv.pool.num_free_blocks == decode.kv.pool.num_usable_blocks


def test_a_block_reused_before_the_copy_is_recomputed(model_dir, prefill, reference):
    first, out = run(prefill, "r1", PROMPT, 1)
    params = out.kv_transfer_params
    prefill.release_kv("r1")
    run(prefill, "other", OTHER, 1)  # 12 blocks in all: this one needs the released blocks
    decode = engine(model_dir, "direct", "consumer")
    tokens, _ = run(decode, "r1", PROMPT, MAX_NEW, first_token_ids=first, kv_transfer_params=params)
    assert tokens == reference
    stats = decode.stats()
    assert stats.recompute_fallbacks == 1 and stats.kv_load_blocks == 0
    assert stats.prompt_tokens_computed == len(PROMPT)


def test_a_block_whose_hold_ended_is_not_read(model_dir, prefill, reference):
    # Once no hold covers a block the pool may hand it out: its generation
    # moves on, and a copy that comes later recomputes, reused or not.
    decode = engine(model_dir, "direct", "consumer")
    tokens, _ = decode_after(prefill, decode, release_first=True)
    assert tokens == reference
    assert decode.stats().kv_load_blocks == 0 and decode.stats().recompute_fallbacks == 1


def test_a_block_still_held_for_another_request_loads(model_dir, prefill, reference):
    # Two prompts share their blocks (a prefix-cache hit): releasing one hold
    # leaves the other's blocks held, so its copy still loads them.
    first, out = run(prefill, "r1", PROMPT, 1)
    _, again = run(prefill, "r2", PROMPT, 1)
    assert again.kv_transfer_params[HANDLE_KEY].block_ids == out.kv_transfer_params[HANDLE_KEY].block_ids
    assert prefill.release_kv("r1")
    decode = engine(model_dir, "direct", "consumer")
    tokens, _ = run(decode, "r2", PROMPT, MAX_NEW, first_token_ids=first,
                    kv_transfer_params=again.kv_transfer_params)
    assert tokens == reference
    assert decode.stats().kv_load_blocks == 4 and decode.stats().recompute_fallbacks == 0


@pytest.mark.parametrize("spoil", ["unreachable", "other model"])
def test_a_cache_that_cannot_be_used_is_computed_around(model_dir, prefill, reference, spoil):
    first, out = run(prefill, "r1", PROMPT, 1)
    handle = out.kv_transfer_params[HANDLE_KEY]
    if spoil == "unreachable":  # e.g. the prefill runs on another host
        handle = dataclasses.replace(handle, export=dataclasses.replace(
            handle.export, generations_shm="tandem-kv-nobody-gen", data_shm="tandem-kv-nobody-data"))
    else:
        handle = dataclasses.replace(handle, model="another-model|torch.float32")
    decode = engine(model_dir, "direct", "consumer")
    tokens, _ = run(decode, "r1", PROMPT, MAX_NEW, first_token_ids=first,
                    kv_transfer_params={HANDLE_KEY: handle})
    assert tokens == reference
    assert decode.stats().recompute_fallbacks == 1 and decode.stats().kv_load_blocks == 0


def test_unclaimed_holds_expire(model_dir):
    prefill = engine(model_dir, "direct", "producer", num_blocks=12, hold_timeout_s=0.0)
    try:
        free_at_start = prefill.kv.pool.num_free_blocks
        run(prefill, "r1", PROMPT, 1)
        assert prefill.scheduler.num_held_blocks == 4
        run(prefill, "r2", [5, 6, 7], 1)  # the next request's arrival ends the expired hold
        assert prefill.scheduler.num_held_blocks == 0
        assert prefill.kv.pool.num_free_blocks == free_at_start
    finally:
        prefill.shutdown()


def test_aborted_and_preempted_requests_hold_nothing(model_dir):
    prefill = engine(model_dir, "direct", "producer", num_blocks=12)
    try:
        prefill.add_request("r1", PROMPT, greedy(1))
        prefill.abort("r1")
        assert prefill.scheduler.num_held_blocks == 0
        assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_usable_blocks
    finally:
        prefill.shutdown()


def test_an_unused_source_is_unmapped(model_dir, prefill, reference, monkeypatch):
    from tandem.engine.connector import direct

    decode = engine(model_dir, "direct", "consumer")
    tokens, params = decode_after(prefill, decode)
    assert tokens == reference and len(decode.connector._opened) == 1
    monkeypatch.setattr(direct, "SOURCE_IDLE_S", 0.0)
    run(decode, "r2", [5, 6, 7], 1)  # any step looks for idle sources
    assert decode.connector._opened == {}
