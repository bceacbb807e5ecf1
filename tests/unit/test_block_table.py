"""The runner's block tables are kept across steps and updated from each
plan alone (new block ids, freed requests); every step, row i must hold
exactly entry i's request's block ids, zeros past them, through new,
finished and preempted requests and ids used again."""
import itertools
import random

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
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8, admission="greedy"), kv)
    table = BlockTable(num_rows=2, width=2)  # starts small: growing is exercised too
    shared = [rng.randrange(2, 500) for _ in range(48)]  # prefix-cache hits on re-admission
    num_preempted = num_finished = 0
    for step in range(400):
        if step < 150 and rng.random() < 0.5:
            # A few ids come back after their request finished (a client's retry).
            rid = f"r{rng.randrange(5)}" if rng.random() < 0.2 else f"r{next(_ids) + 10}"
            if rid not in sched.requests:
                prompt = shared[: rng.randrange(1, 48)] + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 60))]
                sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0)))
        plan = sched.schedule()
        num_preempted += len(plan.preempted_request_ids)
        tables = table.update(plan)
        assert tables.shape[0] == plan.num_entries
        for i, request_id in enumerate(plan.request_ids):
            ids = sched.requests[request_id].block_ids
            assert tables[i, : len(ids)].tolist() == ids, f"step {step}"
            assert not tables[i, len(ids):].any(), f"step {step}"
        # The runner keeps a copy for exactly the requests that hold blocks.
        assert table.num_requests == sum(1 for r in sched.running if r.block_ids)
        n = len(sched.sampling_requests)
        before = len(sched.requests)
        sched.update([rng.randrange(2, 500) for _ in range(n)], [None] * n, {})
        num_finished += before - len(sched.requests)
    assert num_preempted > 0 and num_finished > 20, (num_preempted, num_finished)


def test_a_request_id_used_again_gets_its_own_blocks():
    table = BlockTable(num_rows=2, width=4)
    rid = "again"
    table.update(SchedulerOutput(request_ids=[rid, "b"], new_block_ids=[[5, 6, 7, 8], [1]]))
    tables = table.update(SchedulerOutput(request_ids=[rid, "b"], new_block_ids=[[9], [2]],
                                          freed_request_ids=[rid]))
    assert tables.tolist() == [[9, 0], [1, 2]]
    assert table.table[0].tolist() == [9, 0, 0, 0]  # the old request's blocks are gone


def test_a_row_another_request_lands_on_is_rewritten():
    table = BlockTable(num_rows=2, width=4)
    table.update(SchedulerOutput(request_ids=["a", "b"], new_block_ids=[[5, 6, 7], [1]]))
    # a finished: b moves up to row 0, c takes row 1
    tables = table.update(SchedulerOutput(request_ids=["b", "c"], new_block_ids=[[], [3, 4]],
                                          freed_request_ids=["a"]))
    assert tables.tolist() == [[1, 0], [3, 4]]
