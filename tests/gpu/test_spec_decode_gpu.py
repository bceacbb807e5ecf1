"""Speculative decoding on CUDA: verifying steps replay CUDA graphs of their
own (engine/cuda_graphs.py, query_len 1 + k), with entries of fewer drafts
padded inside the graph's layout, and greedy output stays HF's (fp32, near
ties excepted as elsewhere). Skipped without CUDA."""
from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.test_engine_gpu import hf_greedy_cuda
from tests.support.hf_oracle import compare_with_tie_rule, run_greedy, tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_NEW = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def prompts() -> list[list[int]]:
    """Repeating prompts (prompt lookup proposes k tokens) beside random ones
    (it proposes fewer or none): verifying steps of uniform and of padded rows."""
    rng = random.Random(4)
    looped = [[5, 6, 7, 8, 9, 10] * 8 + [5, 6], [40, 41, 42] * 20, [7, 7, 8] * 12 + [7]]
    return looped + [[rng.randrange(2, 512) for _ in range(n)] for n in (3, 30, 200, 90, 17)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_ngram_greedy_matches_hf_with_verifying_steps_in_graphs(tmp_path, eager):
    from tandem.engine import LLM

    path, hf = tiny_model_dir(tmp_path, "llama")
    hf = hf.cuda()
    ps = prompts()
    llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, num_blocks=1024,
              speculative_config=NGRAM, max_num_seqs=16)
    try:
        runner = llm.engine.runner
        assert (runner.verify_graphs is None) == eager
        outs = run_greedy(llm, ps, MAX_NEW) + run_greedy(llm, ps[:1], MAX_NEW)  # a batch of 8, then of 1
        stats = llm.engine.stats()
        assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
        for p, out in zip(ps + ps[:1], outs):
            ref = hf_greedy_cuda(hf, p, MAX_NEW)
            c = out.outputs[0]
            n = compare_with_tie_rule(c.token_ids, [lp.top for lp in c.logprobs], ref, exact=False)
            assert [lp.logprob for lp in c.logprobs[:n]] == pytest.approx(ref.logprobs[:n], abs=1e-3)
        if not eager:
            graphs = runner.verify_graphs
            assert graphs.replays > graphs.padded_replays > 0, "uniform and padded verifying graphs both ran"
    finally:
        llm.shutdown()
