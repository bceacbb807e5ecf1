"""After the engine's kernel warm-up (engine/kernel_warmup.py), serving
compiles no Triton kernel: a workload of contexts from 1 token to the model's
limit, batches of 1 to 48, chunked prefill mixed with decodes and prefix hits,
eager and with decode CUDA graphs, dense, MoE and FP8. Each compile would be a
stall of every running request (0.6-0.9 s on the H200). Skipped without CUDA
or where Triton cannot report its compiles."""
from __future__ import annotations

import random

import pytest
import torch

from tests.support.hf_oracle import tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_MODEL_LEN = 2048


def workload(seed: int) -> list[list[list[int]]]:
    """Rounds of prompts: each round a batch of another size, the lengths
    spread over the whole context, some prompts of earlier rounds again
    (prefix hits)."""
    rng = random.Random(seed)
    rounds: list[list[list[int]]] = []
    earlier: list[list[int]] = []
    for size in (1, 3, 17, 48, 2, 9):
        batch = [[rng.randrange(2, 500) for _ in range(rng.randint(1, MAX_MODEL_LEN - 80))] for _ in range(size)]
        if earlier:
            batch[0] = earlier[rng.randrange(len(earlier))] + [7, 8]
        earlier += batch
        rounds.append(batch)
    return rounds


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch, quantization", [("llama", None), ("qwen3_moe", None), ("llama", "fp8"),
                                                 ("qwen3_moe", "fp8")],
                         ids=["dense", "moe", "fp8", "fp8-moe"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_serving_compiles_no_kernel_after_the_warm_up(tmp_path, arch, quantization, eager):
    from tandem.engine import LLM, SamplingParams
    from tandem.kernels import compile_log

    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs Ada or Hopper")
    if not compile_log.install():
        pytest.skip("this Triton reports no compiles")
    path, _ = tiny_model_dir(tmp_path, arch, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=MAX_MODEL_LEN)
    llm = LLM(path, device="cuda", enforce_eager=eager, num_blocks=4096, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=48, max_num_batched_tokens=512, long_prefill_token_threshold=256,
              quantization=quantization)
    try:
        before = compile_log.compiles()
        rng = random.Random(1)
        for batch in workload(seed=2):
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 64), ignore_eos=True)
            outs = llm.generate(batch, params)
            assert all(o.outputs[0].token_ids for o in outs)
        compiled = compile_log.compiles() - before
        assert compiled == 0, f"{compiled} kernels compiled while serving: {compile_log.recent(before)}"
    finally:
        llm.shutdown()
