"""The direct KV transfer across processes: a prefill engine in a process of
its own exports its cache (CUDA IPC on the GPU, shared memory on the CPU),
this process's decode engine copies the prompt's blocks from it and answers
exactly as an engine that computed the whole prompt itself."""
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

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs CUDA"))]


def run(engine: LLMEngine, max_tokens: int, **kwargs) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       **kwargs)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_decode_copies_from_a_prefill_in_another_process(tmp_path, device):
    path, _ = tiny_model_dir(tmp_path, "llama")

    def engine(connector=None, role="both") -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                      cache=CacheConfig(block_size=16, num_blocks=256), device=device,
                                      kv_transfer=connector, kv_role=role))

    reference = run(engine(), MAX_NEW)
    producer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.kv_producer", path, device, "float32",
         ",".join(map(str, PROMPT))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = read_answer(producer.stdout)
        handle = common_pb2.KVHandle.FromString(bytes.fromhex(line["handle"]))
        assert handle.HasField("cuda") == (device == "cuda")
        decode = engine("direct", "consumer")
        # Decode's first output carries the token prefill sampled.
        tokens = run(decode, MAX_NEW, first_token_ids=line["first"], kv_transfer_params=handle_from_proto(handle))
        assert tokens == reference
        stats = decode.stats()
        assert stats.kv_load_blocks == len(PROMPT) // 16 and stats.recompute_fallbacks == 0
        assert stats.prompt_tokens_computed == len(PROMPT) % 16
    finally:
        producer.stdin.close()
        producer.wait(timeout=60)
