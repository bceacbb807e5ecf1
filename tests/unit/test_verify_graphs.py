"""The host side of speculative decoding's verifying CUDA graphs
(engine/cuda_graphs.py): which steps a graph takes and where each row goes
in its padded layout. The graphs themselves run in tests/gpu/test_spec_decode_gpu.py."""
from __future__ import annotations

import numpy as np
import torch

from tandem.engine.cuda_graphs import padded_rows, verify_buckets
from tandem.engine.model_runner import verify_shape
from tandem.engine.plan import SchedulerOutput
from tests.support.emulated_graphs import EmulatedGraphs


def test_rows_of_entries_with_fewer_drafts_go_first_in_their_slot():
    assert padded_rows(np.array([5, 1, 3]), 5).tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 12]
    assert padded_rows(np.array([4, 4]), 4).tolist() == list(range(8))  # uniform: the same layout
    assert padded_rows(np.array([1]), 4).tolist() == [0]


def test_verify_buckets_stay_within_the_token_budget():
    assert verify_buckets(256, 5, 8192)[-1] == 256
    assert max(verify_buckets(1024, 5, 2048)) * 5 <= 2048
    assert verify_buckets(8, 5, 3) == [1]  # always one, even past the budget


def plan(num_computed, num_new, drafts, sampled=None) -> SchedulerOutput:
    out = SchedulerOutput()
    out.request_ids = [f"r{i}" for i in range(len(num_new))]
    out.num_computed_tokens, out.num_new_tokens = list(num_computed), list(num_new)
    out.token_ids = [0] * sum(num_new)
    out.sampled = list(range(len(num_new))) if sampled is None else sampled
    out.num_draft_tokens = list(drafts)
    return out


def test_a_graph_takes_decodes_with_drafts_only():
    q_lens, computed = verify_shape(plan([10, 20, 7], [4, 1, 3], [3, 0, 2]))
    assert q_lens.tolist() == [4, 1, 3] and computed.tolist() == [10, 20, 7]
    assert verify_shape(plan([10], [1], [0])) is None  # no drafts: a plain decode
    assert verify_shape(plan([0, 5], [30, 4], [0, 3])) is None  # a prompt chunk beside a verify
    assert verify_shape(plan([0, 5], [30, 4], [3], sampled=[1])) is None  # an entry that does not sample
    assert verify_shape(SchedulerOutput()) is None


def test_verifying_steps_through_the_graph_layout_give_the_eager_tokens(tmp_path):
    """The same requests, speculating, with and without the graphs' layout
    (verifying batches uniform and padded, padding sequences; decode
    batches; the LM head over each bucket's rows): the same greedy tokens. Real CUDA graphs: tests/gpu/test_spec_decode_gpu.py."""
    import random

    from tandem.engine import LLM, SamplingParams
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama")
    rng = random.Random(4)
    prompts = [[5, 6, 7, 8, 9, 10] * 8 + [5, 6], [40, 41, 42] * 20, [7, 7, 8] * 12 + [7]]
    prompts += [[rng.randrange(2, 512) for _ in range(n)] for n in (3, 30, 200, 17)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for emulate in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8, speculative_config=spec)
        try:
            runner = llm.engine.runner
            if emulate:  # decode steps through the decode graphs' layout too
                layout = (runner.model, runner.kv_caches, 8, llm.engine.max_model_len, runner.block_size,
                          torch.device("cpu"))
                runner.graphs = EmulatedGraphs(*layout)
                runner.verify_graphs = EmulatedGraphs(*layout, query_len=4)
            tokens[emulate] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            tokens[emulate] += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]
            if emulate:
                graphs = runner.verify_graphs
                assert graphs.replays > graphs.padded_replays > 0, (graphs.replays, graphs.padded_replays)
                assert runner.graphs.replays > 0
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False]
