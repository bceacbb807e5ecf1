"""The store connector on CUDA: a prefill engine on the GPU stages every
layer of its prompt's blocks from the device cache and puts them into a real
KV store process; a decode engine on the GPU loads them into its device cache
and answers as an engine that computed the whole prompt (and runs on the CPU
too, as the CI's stand-in). Both ways the blocks can take: through the
staging arena (--kv-store-slots off), and straight into and out of the
store's own slots, one DMA per block on a GPU (auto on a GPU, on for the CPU);
and with an FP8 cache (--kv-cache-dtype fp8), whose e4m3 blocks travel as bytes."""
from __future__ import annotations

import pytest
import torch

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
from tandem.engine.llm_engine import LLMEngine
from tests.support.hf_oracle import tiny_model_dir

pytest.importorskip("tandem.v1.kvstore_pb2_grpc", reason="gRPC stubs not generated")

from tandem.services.kvstore.block_client import BlockStoreClient  # noqa: E402
from tests.support.kvstore_process import start_store  # noqa: E402

BLOCK = 16
PROMPT = [(5 * i + 2) % 400 + 7 for i in range(7 * BLOCK + 9)]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (device, --kv-store-slots, --kv-cache-dtype): the arena, and the store's own slots
DEVICES = [("cpu", "off", "auto"), ("cpu", "on", "auto"), ("cpu", "on", "fp8"),
           pytest.param("cuda", "off", "auto", marks=CUDA), pytest.param("cuda", "auto", "auto", marks=CUDA),
           pytest.param("cuda", "off", "fp8", marks=CUDA), pytest.param("cuda", "auto", "fp8", marks=CUDA)]


def engine(path: str, device: str, store: str = None, role: str = "both", slots: str = "off",
           kv: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=128, cache_dtype=kv), device=device,
                                  kv_transfer="store" if store else None, kv_role=role, kv_store_slots=slots),
                     kv_store=BlockStoreClient(store, timeout_s=10.0) if store else None)


def run(eng: LLMEngine, max_tokens: int, **kwargs) -> list[int]:
    eng.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    **kwargs)
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("device,slots,kv", DEVICES)
def test_blocks_saved_from_one_engines_cache_load_into_anothers(tmp_path, device, slots, kv):
    path, _ = tiny_model_dir(tmp_path, "llama")
    reference = run(engine(path, device, kv=kv), 8)
    store = start_store("--backend", "memory", "--capacity", "256MiB")
    lent = 0 if slots == "off" else 7
    try:
        producer = engine(path, device, store.target, "producer", slots, kv)
        first = run(producer, 1)
        producer.connector.close()  # waits for its puts, which the prefill does not wait for
        saved = producer.connector.stats
        assert saved.save_blocks == 7 and saved.save_failures == 0 and saved.save_blocks_lent == lent
        consumer = engine(path, device, store.target, "consumer", slots, kv)
        assert run(consumer, 8, first_token_ids=first) == reference
        stats = consumer.stats()
        assert stats.kv_load_blocks == 7 and stats.prompt_tokens_external == 7 * BLOCK
        assert stats.recompute_fallbacks == 0 and stats.kv_load_blocks_lent == lent
        consumer.shutdown()
    finally:
        store.stop()
