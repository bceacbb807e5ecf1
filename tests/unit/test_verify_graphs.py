"""The host side of speculative decoding's verifying CUDA graphs
(engine/cuda_graphs.py): which steps a graph takes and where each row goes
in its padded layout. The graphs themselves run in tests/gpu/test_spec_decode_gpu.py."""
from __future__ import annotations

import numpy as np

from tandem.engine.cuda_graphs import padded_rows, verify_buckets
from tandem.engine.model_runner import verify_shape
from tandem.engine.plan import SchedulerOutput


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
