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


class CountingPiecewiseGraphs(EmulatedPiecewiseGraphs):
    """Counts the replays that carried the KV connector's hooks, and checks
    that each layer's hooks ran around its own attention: before_layer(i)
    after layer i - 1's attention and before layer i's, after_layer(i) after
    layer i's and before layer i + 1's."""

    hooked = 0

    def run(self, input_ids, positions, meta, before_layer=None, after_layer=None):
        if before_layer is None and after_layer is None:
            return super().run(input_ids, positions, meta)
        self.hooked += 1
        events: list[tuple[str, int]] = []

        def logged(kind, hook):
            return None if hook is None else (lambda i: (events.append((kind, i)), hook(i))[1])
        for i, layer in enumerate(self.layers):
            attend = layer.self_attn.attend
            layer.self_attn.attend = lambda *a, i=i, f=attend: (events.append(("attend", i)), f(*a))[1]
        try:
            out = super().run(input_ids, positions, meta, logged("before", before_layer),
                              logged("after", after_layer))
        finally:
            for layer in self.layers:
                del layer.self_attn.attend
        for kind, hook, step in (("before", before_layer, -1), ("after", after_layer, 1)):
            if hook is None:
                continue
            for i in range(len(self.layers)):
                at, own = events.index((kind, i)), events.index(("attend", i))
                assert (at - own) * step > 0, (kind, i, events)
                if ("attend", i + step) in events:
                    assert (events.index(("attend", i + step)) - at) * step > 0, (kind, i, events)
        return out


def test_the_kv_connectors_loads_and_saves_run_between_the_pieces(tmp_path):
    """Two engines over one KV store (a real store process): the first saves
    its prompts' blocks and the second loads them, both through the pieces
    with the connector's layer hooks between them; both answer as an eager
    engine without a store."""
    from tandem.engine import LLM, SamplingParams
    from tandem.services.kvstore.block_client import BlockStoreClient
    from tests.support.kvstore_process import start_store

    path, _ = tiny_model_dir(tmp_path, "llama")
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=BUDGET)
    llm = LLM(path, **settings)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.shutdown()
    store = start_store("--backend", "memory", "--capacity", "64MiB")
    try:
        for role in ("saves", "loads"):
            llm = LLM(path, kv_transfer="store", kv_role="both",
                      kv_store=BlockStoreClient(store.target, timeout_s=10.0), **settings)
            try:
                runner = llm.engine.runner
                runner.piecewise = CountingPiecewiseGraphs(runner.model, runner.kv_caches, BUDGET,
                                                           torch.device("cpu"))
                assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, role
                stats = llm.engine.stats()
                assert runner.piecewise.hooked > 0, role
            finally:
                llm.shutdown()
        assert stats.kv_load_blocks > 0 and stats.recompute_fallbacks == 0
    finally:
        store.stop()


def test_steps_with_drafts_beside_prompt_chunks_go_through_the_pieces(tmp_path):
    """Prompt lookup under a 64-token budget: steps that verify drafts beside
    a prompt chunk take the pieces, and their rows are taken by the logits
    indices of a verifying step; the same greedy tokens as the eager engine."""
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "llama")
    prompts = [[5, 6, 7, 8, 9, 10] * 8 + [5, 6], [40, 41, 42] * 20] + _prompts()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens, drafted = {}, 0
    for emulate in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8,
                  max_num_batched_tokens=BUDGET, speculative_config=spec)
        try:
            runner = llm.engine.runner
            if emulate:
                runner.piecewise = EmulatedPiecewiseGraphs(runner.model, runner.kv_caches, BUDGET,
                                                           torch.device("cpu"))
                run = runner.piecewise.run

                def counting(input_ids, positions, meta, *hooks):
                    nonlocal drafted
                    drafted += bool(llm.engine.scheduler.sampling_drafts and any(llm.engine.scheduler.sampling_drafts))
                    return run(input_ids, positions, meta, *hooks)
                runner.piecewise.run = counting
            tokens[emulate] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert drafted > 0, "no step carried drafts through the pieces"
    assert tokens[True] == tokens[False]
