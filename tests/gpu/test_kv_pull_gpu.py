"""KV transfers a decode pulls from a prefill in another process: a prefill
engine in a process of its own holds a prompt's blocks and hands out a
handle; this process's decode engine copies the blocks out of the prefill's
cache and answers exactly as an engine that computed the whole prompt itself.

- direct: the prefill's cache is exported (CUDA IPC on the GPU, shared
  memory on the CPU) and copied from;
- nixl: the prefill registers its cache with NIXL (VRAM on the GPU) and the
  decode reads it through UCX (CUDA IPC or copies on one host, RDMA between
  hosts); skipped without NIXL installed."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
from tandem.engine.llm_engine import LLMEngine
from tests.support.hf_oracle import tiny_model_dir
from tests.support.kv_producer import read_answer

# The gRPC stubs are generated at install; a GPU machine running the tree from
# PYTHONPATH (bench/gpu_figures.sh) may have none, and must still run the rest.
common_pb2 = pytest.importorskip("tandem.v1.common_pb2", reason="gRPC stubs not generated")
from tandem.services.common.kv_handle import handle_from_proto  # noqa: E402  (needs the stubs)

PROMPT = [(7 * i + 3) % 500 + 2 for i in range(300)]  # 18 full blocks and 12 tokens
MAX_NEW = 12

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _has_nixl() -> bool:
    try:
        from tandem.engine.connector.nixl import nixl_api

        nixl_api()
        return True
    except ImportError:
        return False


NO_NIXL = pytest.mark.skipif(not _has_nixl(), reason="NIXL is not installed")
NO_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# (transfer, device, tensor parallelism of the prefill and of the decode)
CASES = [pytest.param("direct", "cpu", 1, id="direct-cpu"),
         pytest.param("direct", "cuda", 1, id="direct-cuda", marks=NO_CUDA),
         # Each side on two GPUs: every prefill rank's cache through CUDA IPC,
         # assembled whole on the decode's rank 0 and split to its rank 1.
         pytest.param("direct", "cuda", 2, id="direct-cuda-tp2-to-tp2", marks=NO_TWO_GPUS),
         pytest.param("nixl", "cuda", 1, id="nixl-cuda", marks=[NO_CUDA, NO_NIXL])]


def run(engine: LLMEngine, max_tokens: int, **kwargs) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       **kwargs)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("transfer, device, tp", CASES)
def test_decode_copies_from_a_prefill_in_another_process(tmp_path, transfer, device, tp):
    path, _ = tiny_model_dir(tmp_path, "llama")  # 4 heads, 2 KV heads: TP=2 splits them

    def engine(connector=None, role="both", tensor_parallel_size=1) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                      cache=CacheConfig(block_size=16, num_blocks=256), device=device,
                                      kv_transfer=connector, kv_role=role,
                                      tensor_parallel_size=tensor_parallel_size))

    reference_engine = engine()
    reference = run(reference_engine, MAX_NEW)
    reference_engine.shutdown()
    producer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.kv_producer", path, device, "float32",
         ",".join(map(str, PROMPT)), transfer, str(tp)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    decode = None
    try:
        line = read_answer(producer.stdout)
        handle = common_pb2.KVHandle.FromString(bytes.fromhex(line["handle"]))
        if transfer == "direct":
            assert handle.HasField("cuda") == (device == "cuda")
            assert len(handle.rank_caches) == tp - 1
        else:
            assert handle.nixl.mem_type == "VRAM"
        decode = engine(transfer, "consumer", tp)
        # Decode's first output carries the token prefill sampled.
        tokens = run(decode, MAX_NEW, first_token_ids=line["first"], kv_transfer_params=handle_from_proto(handle))
        assert tokens == reference
        stats = decode.stats()
        assert stats.kv_load_blocks == len(PROMPT) // 16 and stats.recompute_fallbacks == 0
        assert stats.prompt_tokens_computed == len(PROMPT) % 16
    finally:
        if decode is not None:
            decode.shutdown()
        producer.stdin.close()
        producer.wait(timeout=60)
