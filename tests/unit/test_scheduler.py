"""Scheduler invariants, driven step by step without a model: the plan says
which tokens are computed; a stand-in sampler hands the real update step one
token per sampling request (the real scheduler, the real KV cache manager,
the real stop rules)."""
import itertools

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler

_ids = itertools.count()


def make(num_blocks=64, budget=64, policy="fifo", caching=True, max_num_seqs=256, admission="reserve"):
    kv = KVCacheManager(num_blocks, 16, caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, policy=policy, max_num_seqs=max_num_seqs,
                                     admission=admission), kv)


def request(n_prompt, max_tokens=4, tokens=None):
    ids = tokens or [next(_ids) % 1000 + 2 for _ in range(n_prompt)]
    return Request(f"r{next(_ids)}", ids, SamplingParams(max_tokens=max_tokens, temperature=0))


def step(sched: Scheduler):
    """One engine step minus the model; returns the plan."""
    plan = sched.schedule()
    assert plan.num_scheduled_tokens <= sched.config.max_num_batched_tokens
    for request_id in plan.request_ids:
        request = sched.requests[request_id]
        assert request.num_computed_tokens <= request.num_tokens
    n = len(sched.sampling_requests)
    sched.update([7] * n, [None] * n, {})
    return plan


def entries(plan):
    """(request id, tokens computed) of each entry."""
    return list(zip(plan.request_ids, plan.num_new_tokens))


def run_all(sched, limit=1000):
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("requests did not finish")


def test_long_prompt_is_chunked_under_the_budget():
    sched = make(budget=32)
    r = request(100)
    sched.add_request(r)
    sizes = []
    while r.num_output_tokens == 0:
        sizes.append(step(sched).num_scheduled_tokens)
    assert sizes == [32, 32, 32, 4]


def test_running_decodes_are_scheduled_before_waiting_prefills():
    sched = make(budget=40)
    a = request(10)
    sched.add_request(a)
    step(sched)  # a prefilled, now decoding
    b = request(100)
    sched.add_request(b)
    plan = step(sched)
    assert entries(plan) == [(a.request_id, 1), (b.request_id, 39)]


def test_no_block_leaks_after_finish_and_abort():
    sched = make(num_blocks=40)
    free0 = sched.kv.pool.num_free_blocks
    reqs = [request(n, max_tokens=6) for n in (5, 40, 70, 16, 33)]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    step(sched)
    sched.abort(reqs[2].request_id)
    assert reqs[2].status is RequestStatus.FINISHED_ABORTED
    run_all(sched)
    assert sched.kv.pool.num_free_blocks == free0
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_preemption_by_recompute_resets_progress_and_finishes_everything():
    # 11 usable blocks; greedy admission: reserving for the outputs would
    # start the third request only once another finished.
    sched = make(num_blocks=12, budget=256, admission="greedy")
    reqs = [request(40, max_tokens=30) for _ in range(3)]  # 3 blocks each to start, 5 at the end
    for r in reqs:
        sched.add_request(r)
    preempted = []
    for _ in range(500):
        if not sched.has_unfinished():
            break
        plan = step(sched)
        for request_id in plan.preempted_request_ids:
            p = sched.requests[request_id]
            assert p.num_computed_tokens == 0 and p.status is RequestStatus.PREEMPTED
            assert request_id in plan.freed_request_ids  # the runner drops its row
            preempted.append(p)
        assert all(b.ref_cnt >= 0 for b in sched.kv.pool.blocks)
    assert preempted, "the cache was sized to force preemption"
    assert all(r.num_output_tokens == 30 for r in reqs)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_prefix_cache_hit_reuses_blocks_instead_of_recomputing():
    sched = make(budget=512)
    shared = [5] * 64
    a = request(0, tokens=shared + [9, 9])
    sched.add_request(a)
    first = step(sched)
    assert first.num_scheduled_tokens == 66
    b = request(0, tokens=shared + [8, 8, 8])
    sched.add_request(b)
    plan = sched.schedule()
    computed_for_b = [n for rid, n in entries(plan) if rid == b.request_id]
    assert computed_for_b == [3], "64 shared tokens come from the cache"
    assert b.num_cached_tokens == 64
    assert a.block_ids[:4] == b.block_ids[:4]
    i = plan.request_ids.index(b.request_id)
    assert plan.new_block_ids[i] == b.block_ids  # a new request's entry names all its blocks


def test_full_prompt_hit_still_computes_the_last_token():
    sched = make(budget=512)
    tokens = [3] * 32
    sched.add_request(request(0, tokens=tokens, max_tokens=1))
    run_all(sched)
    again = request(0, tokens=tokens, max_tokens=1)
    sched.add_request(again)
    plan = step(sched)
    assert plan.num_new_tokens == [16]  # one block hit; the last block computes its logits


def test_srtf_prefers_the_shortest_remaining_prompt():
    sched = make(budget=64, policy="srtf")
    long, short = request(200), request(10)
    sched.add_request(long)
    sched.add_request(short)
    plan = step(sched)
    assert plan.request_ids[0] == short.request_id


def test_srtf_never_starves_a_long_prompt():
    """Short prompts arrive every step forever; the long one must still finish,
    because staging refills only once it is empty (thesis 4.5.3)."""
    sched = make(num_blocks=256, budget=32, policy="srtf")
    long = request(300, max_tokens=2)
    sched.add_request(long)
    for i in range(400):
        sched.add_request(request(8, max_tokens=2))
        step(sched)
        if long.is_finished:
            break
    assert long.is_finished, "SRTF starved the long prompt"


def test_fifo_head_of_line_blocks_but_srtf_does_not():
    results = {}
    for policy in ("fifo", "srtf"):
        sched = make(budget=32, policy=policy)
        long, short = request(320, max_tokens=1), request(8, max_tokens=1)
        sched.add_request(long)
        sched.add_request(short)
        steps = 0
        while not short.is_finished:
            step(sched)
            steps += 1
        results[policy] = steps
    assert results["srtf"] == 1 and results["fifo"] > 5

