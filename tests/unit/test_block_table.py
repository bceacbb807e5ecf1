"""The runner's block-table rows live across steps, updated from each plan's
new block ids and freed requests; every step, each entry's row must hold
exactly its request's block ids (zeros past them), through new, finished and
preempted requests, and rows of requests that are gone must be reused."""
import itertools
import random

import numpy as np

from tandem.engine.block_table import BlockTable
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.plan import SchedulerOutput
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler

_ids = itertools.count()


def test_rows_equal_each_requests_block_ids_through_preemption_and_churn():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=16)  # small: preemption happens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8), kv)
    table = BlockTable(num_rows=2, width=2)  # starts small: growing is exercised too
    shared = [rng.randrange(2, 500) for _ in range(48)]  # prefix-cache hits on re-admission
    num_preempted = num_finished = 0
    for step in range(400):
        if step < 150 and rng.random() < 0.5:
            prompt = shared[: rng.randrange(1, 48)] + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 60))]
            sched.add_request(Request(f"r{next(_ids)}", prompt,
                                      SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0)))
        plan = sched.schedule()
        num_preempted += len(plan.preempted_request_ids)
        rows = table.update(plan)
        for request_id, row in zip(plan.request_ids, rows):
            ids = sched.requests[request_id].block_ids
            assert table.table[row, : len(ids)].tolist() == ids, f"step {step}"
            assert not table.table[row, len(ids):].any(), f"step {step}"
        assert len(set(rows.tolist())) == len(rows)
        # Only requests that hold blocks keep a row.
        assert table.num_rows_used == sum(1 for r in sched.running if r.block_ids)
        n = len(sched.sampling_requests)
        before = len(sched.requests)
        sched.update([rng.randrange(2, 500) for _ in range(n)], [None] * n, {})
        num_finished += before - len(sched.requests)
    assert num_preempted > 0 and num_finished > 20, (num_preempted, num_finished)
    assert table.table.shape[0] <= 16  # rows of finished requests were reused


def test_a_freed_row_is_zeroed_and_reused():
    table = BlockTable(num_rows=2, width=4)
    first = table.update(SchedulerOutput(request_ids=["a", "b"], new_block_ids=[[5, 6, 7, 8], [1]]))
    rows = table.update(SchedulerOutput(request_ids=["c", "b"], new_block_ids=[[9], [2]],
                                        freed_request_ids=["a"]))
    assert rows.tolist() == first.tolist()  # c took a's row
    assert table.table[rows[0]].tolist() == [9, 0, 0, 0]
    assert table.table[rows[1], :2].tolist() == [1, 2]
    assert np.array_equal(table.lens[rows], [1, 2])
