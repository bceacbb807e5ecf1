"""The runner's block tables are updated in place across steps; they must equal
a from-scratch build every step, through new, finished and preempted requests."""
import itertools
import random

import numpy as np

from tandem.engine.block_table import BlockTables
from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler

_ids = itertools.count()


def from_scratch(block_ids: list[list[int]]) -> np.ndarray:
    width = max(map(len, block_ids), default=0)
    table = np.zeros((len(block_ids), width), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table


def test_incremental_block_tables_equal_a_rebuild_through_preemption_and_churn():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=16)  # small: preemption happens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8), CacheConfig(), kv)
    tables = BlockTables(num_rows=2, width=2)  # starts small: growing is exercised too
    shared = [rng.randrange(2, 500) for _ in range(48)]  # prefix-cache hits on re-admission
    num_preempted = num_finished = 0
    for step in range(400):
        if step < 150 and rng.random() < 0.5:
            prompt = shared[: rng.randrange(1, 48)] + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 60))]
            sched.add_request(Request(f"r{next(_ids)}", prompt,
                                      SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0)))
        plan = sched.schedule()
        num_preempted += len(plan.preempted)
        if plan.is_empty:
            continue
        lists = [s.block_ids for s in plan.scheduled]
        assert np.array_equal(tables.update(lists), from_scratch(lists)), f"step {step}"
        for s in plan.scheduled:
            if s.samples:
                s.request.append_token(rng.randrange(2, 500))
                if s.request.num_output_tokens >= s.request.params.max_tokens:
                    sched.finish(s.request, RequestStatus.FINISHED_LENGTH)
                    num_finished += 1
    assert num_preempted > 0 and num_finished > 20, (num_preempted, num_finished)


def test_a_row_taken_by_a_shorter_list_is_zeroed_past_it():
    tables = BlockTables(num_rows=2, width=4)
    long, short = [5, 6, 7, 8], [9]
    tables.update([long, [1]])
    assert tables.update([short, [1, 2]]).tolist() == [[9, 0], [1, 2]]
    assert tables.table[0].tolist() == [9, 0, 0, 0]
