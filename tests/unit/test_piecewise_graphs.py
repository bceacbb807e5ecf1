"""The host side of the piecewise CUDA graphs (engine/piecewise_graphs.py):
steps of prompt chunks, alone or beside decodes, through the pieces' buffers,
buckets and padding give the eager engine's greedy tokens. The capture is
emulated here (tests/support/emulated_graphs.py); real graphs run in
tests/gpu/test_engine_gpu.py (mode "piecewise")."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.piecewise_graphs import MAX_TOKENS
from tests.support.emulated_graphs import EmulatedPiecewiseGraphs
from tests.support.hf_oracle import tiny_model_dir

BUDGET = 64  # tokens a step: prompts go in chunks, beside the decodes of the others


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(2, 512) for _ in range(40)]  # a prefix the later prompts hit in the cache
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (3, 30, 150, 17, 1)]
    return prompts + [shared + [rng.randrange(2, 512) for _ in range(n)] for n in (0, 9, 70)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_mixed_steps_through_the_pieces_give_the_eager_tokens(tmp_path, arch):
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, arch)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for emulate in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8,
                  max_num_batched_tokens=BUDGET)
        try:
            runner = llm.engine.runner
            if emulate:
                runner.piecewise = EmulatedPiecewiseGraphs(runner.model, runner.kv_caches, BUDGET,
                                                           torch.device("cpu"))
            # Twice: the second time the shared prefix comes from the cache.
            tokens[emulate] = [o.outputs[0].token_ids for _ in range(2) for o in llm.generate(prompts, params)]
            if emulate:
                # Every step here has at most BUDGET tokens, so each one that is
                # not all decodes went through the pieces; most have padding.
                assert runner.piecewise.replays > 10, runner.piecewise.replays
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False]


def test_buckets_stop_at_the_budget_and_at_max_tokens(tmp_path):
    from tandem.engine import LLM

    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=64)
    try:
        runner = llm.engine.runner
        small = EmulatedPiecewiseGraphs(runner.model, runner.kv_caches, 40, torch.device("cpu"))
        assert small.sizes[-1] == 32 and small.bucket(33) is None and small.bucket(5) == 8
        large = EmulatedPiecewiseGraphs(runner.model, runner.kv_caches, 8192, torch.device("cpu"))
        assert large.sizes[-1] == MAX_TOKENS and large.bucket(MAX_TOKENS + 1) is None
        assert len(large.graphs[MAX_TOKENS]) == len(runner.model.model.layers) + 1
    finally:
        llm.shutdown()
