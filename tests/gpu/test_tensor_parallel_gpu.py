"""Tensor parallelism across GPUs (NCCL, one rank per GPU): greedy tokens
and logprobs of a TP=2 engine against HF transformers in fp32 on the same
GPU, eager and with decode CUDA graphs (whose captures hold the all-reduces),
with chunked prefill and a prefix hit; and a TP=2 bf16 engine against a TP=1
one. Skipped without two GPUs."""
from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.test_engine_gpu import hf_greedy_cuda
from tests.support.hf_oracle import compare_with_tie_rule, tiny_model_dir

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

LENGTHS = [1, 5, 17, 33, 64, 150, 300, 7]
MAX_NEW = 16


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tp2_on_two_gpus_matches_hf(tmp_path, eager):
    from tandem.engine import LLM, SamplingParams

    # head_dim 16: the smallest the Triton kernels take
    path, hf = tiny_model_dir(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=128)
    hf = hf.cuda()
    ps = prompts()
    prefix_prompt = ps[6][:40] + [9, 10, 11]  # 32 tokens of prompt 6 cached by then
    llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, num_blocks=512,
              tensor_parallel_size=2, max_num_batched_tokens=128, long_prefill_token_threshold=64,
              max_num_seqs=16)
    try:
        runner = llm.engine.runner
        assert runner.device == torch.device("cuda", 0)
        assert runner.model.model.layers[0].self_attn.num_heads == 4
        assert (runner.graphs is None) == eager
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
        outs = llm.generate(ps, params) + llm.generate([prefix_prompt], params)
        assert outs[-1].num_cached_tokens == 32
        for p, out in zip(ps + [prefix_prompt], outs):
            ref = hf_greedy_cuda(hf, p, MAX_NEW)
            c = out.outputs[0]
            n = compare_with_tie_rule(c.token_ids, [lp.top for lp in c.logprobs], ref, exact=False)
            assert [lp.logprob for lp in c.logprobs[:n]] == pytest.approx(ref.logprobs[:n], abs=1e-3)
    finally:
        llm.shutdown()


@pytest.mark.timeout(600)
def test_tp2_bf16_agrees_with_tp1(tmp_path):
    """bf16 sums in another order across ranks: most greedy tokens, not all."""
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "qwen3", num_attention_heads=8, num_key_value_heads=4)
    ps = prompts(5)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(path, device="cuda", num_blocks=512, tensor_parallel_size=tp, max_num_seqs=16)
        try:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
        finally:
            llm.shutdown()
    first_tokens = sum(a[0] == b[0] for a, b in zip(tokens[1], tokens[2]))
    assert first_tokens >= len(ps) - 1
