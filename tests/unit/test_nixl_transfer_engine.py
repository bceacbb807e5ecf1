"""The NIXL KV transfer at engine level (CPU, UCX): a decode engine reads a
prefill engine's blocks through NIXL and answers exactly as an engine that
computed the whole prompt; a block no hold covers any more, an agent it
cannot reach and another model's cache fall back to computing; no block
leaks. Both engines run in this process here (each with its own NIXL agent);
tests/e2e/test_nixl_transfer.py runs them as separate services."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("tandem.engine.connector.nixl").nixl_api()  # skips without NIXL installed

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from tandem.engine.connector.nixl import HANDLE_KEY  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.services.common.kv_handle import handle_from_proto, handle_to_proto  # noqa: E402
from tests.support.hf_oracle import tiny_model_dir  # noqa: E402

BLOCK = 16
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(75)]  # 4 full blocks and 11 tokens
MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("nixl"), "llama")
    return path


def engine(model_dir: str, transfer=None, role="both", num_blocks=64) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                                  device="cpu", kv_transfer=transfer, kv_role=role))


def run(eng: LLMEngine, rid: str, max_tokens: int, **kwargs):
    eng.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    **kwargs)
    tokens, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                last = out
    return tokens, last


@pytest.fixture(scope="module")
def reference(model_dir):
    return run(engine(model_dir), "ref", MAX_NEW)[0]


@pytest.fixture
def prefill(model_dir):
    eng = engine(model_dir, "nixl", "producer", num_blocks=12)
    yield eng
    eng.shutdown()


def over_the_wire(params: dict) -> dict:
    """What the decode gets: the handle through the prefill reply's proto, as the router passes it."""
    return handle_from_proto(handle_to_proto(params))


def test_decode_reads_the_prefills_blocks_through_nixl_and_answers_the_same(model_dir, prefill, reference):
    free_at_start = prefill.kv.pool.num_free_blocks
    first, out = run(prefill, "r1", 1)
    decode = engine(model_dir, "nixl", "consumer")
    tokens, _ = run(decode, "r1", MAX_NEW, first_token_ids=first,
                    kv_transfer_params=over_the_wire(out.kv_transfer_params))
    assert tokens == reference
    stats = decode.stats()
    assert stats.kv_load_blocks == 4 and stats.recompute_fallbacks == 0
    assert stats.prompt_tokens_external == 4 * BLOCK
    assert prefill.scheduler.num_held_blocks == 4
    assert prefill.release_kv("r1") and prefill.kv.pool.num_free_blocks == free_at_start
    decode.shutdown()


def test_a_block_whose_hold_ended_is_not_read(model_dir, prefill, reference):
    first, out = run(prefill, "r1", 1)
    assert prefill.release_kv("r1")
    decode = engine(model_dir, "nixl", "consumer")
    tokens, _ = run(decode, "r1", MAX_NEW, first_token_ids=first,
                    kv_transfer_params=over_the_wire(out.kv_transfer_params))
    assert tokens == reference
    assert decode.stats().kv_load_blocks == 0 and decode.stats().recompute_fallbacks == 1
    decode.shutdown()


@pytest.mark.parametrize("spoil", ["unreachable", "other model"])
def test_a_cache_that_cannot_be_read_is_computed_around(model_dir, prefill, reference, spoil):
    first, out = run(prefill, "r1", 1)
    handle = out.kv_transfer_params[HANDLE_KEY]
    if spoil == "unreachable":
        handle = dataclasses.replace(handle, agent="tandem-nobody", metadata=b"not nixl metadata")
    else:
        handle = dataclasses.replace(handle, model="another-model|torch.float32")
    decode = engine(model_dir, "nixl", "consumer")
    tokens, _ = run(decode, "r1", MAX_NEW, first_token_ids=first, kv_transfer_params={HANDLE_KEY: handle})
    assert tokens == reference
    assert decode.stats().recompute_fallbacks == 1 and decode.stats().kv_load_blocks == 0
    decode.shutdown()
