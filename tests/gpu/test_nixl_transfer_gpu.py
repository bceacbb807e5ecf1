"""The NIXL KV transfer on GPU memory, across processes: a prefill engine in a
process of its own registers its CUDA KV cache with NIXL (VRAM), this
process's decode engine reads the prompt's blocks out of it through UCX
(CUDA IPC or copies on one host, RDMA between hosts) into its own CUDA cache
and answers exactly as an engine that computed the whole prompt itself."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("tandem.engine.connector.nixl").nixl_api()  # skips without NIXL installed
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
common_pb2 = pytest.importorskip("tandem.v1.common_pb2", reason="gRPC stubs not generated")

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.services.common.kv_handle import handle_from_proto  # noqa: E402  (needs the stubs)
from tests.support.hf_oracle import tiny_model_dir  # noqa: E402
from tests.support.kv_producer import read_answer  # noqa: E402

PROMPT = [(7 * i + 3) % 500 + 2 for i in range(300)]  # 18 full blocks and 12 tokens
MAX_NEW = 12


def run(engine: LLMEngine, max_tokens: int, **kwargs) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       **kwargs)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_decode_reads_a_prefills_gpu_cache_through_nixl(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")

    def engine(connector=None, role="both") -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                      cache=CacheConfig(block_size=16, num_blocks=256), device="cuda",
                                      kv_transfer=connector, kv_role=role))

    reference = run(engine(), MAX_NEW)
    producer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.kv_producer", path, "cuda", "float32",
         ",".join(map(str, PROMPT)), "nixl"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = read_answer(producer.stdout)
        params = handle_from_proto(common_pb2.KVHandle.FromString(bytes.fromhex(line["handle"])))
        assert params["nixl"].mem_type == "VRAM"
        decode = engine("nixl", "consumer")
        tokens = run(decode, MAX_NEW, first_token_ids=line["first"], kv_transfer_params=params)
        assert tokens == reference
        stats = decode.stats()
        assert stats.kv_load_blocks == len(PROMPT) // 16 and stats.recompute_fallbacks == 0
        assert stats.prompt_tokens_computed == len(PROMPT) % 16
    finally:
        producer.stdin.close()
        producer.wait(timeout=60)
