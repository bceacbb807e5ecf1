"""The scheduler settles most decodes through KVCacheManager.append_slots
(and a decode into a new block through append_block) without the general
path's bookkeeping. It must plan exactly what the general
path plans: two schedulers, one with the fast path switched off, fed the same
requests and tokens, make the same plan every step, through block boundaries,
prefix-cache naming, preemption and finished requests, under both policies."""
import gc
import random
import weakref

import pytest

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler


class GeneralPathOnly(KVCacheManager):
    def append_slots(self, requests):
        return [None] * len(requests)

    def append_block(self, request):
        return None


def plan_of(out):
    return ([(s.request.request_id, s.start, s.num_new_tokens, list(s.block_ids)) for s in out.scheduled],
            [r.request_id for r in out.preempted])


@pytest.mark.parametrize("policy", ["fifo", "srtf"])
@pytest.mark.parametrize("enable_caching", [True, False])
# A budget of 7 tokens: prompts are chunked and running decodes wait their turn.
@pytest.mark.parametrize("budget", [64, 7])
def test_fast_path_plans_what_the_general_path_plans(policy, enable_caching, budget):
    rng = random.Random(1)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=12, policy=policy)
    twins = [Scheduler(config, CacheConfig(), cls(num_blocks=40, block_size=8, enable_caching=enable_caching))
             for cls in (KVCacheManager, GeneralPathOnly)]
    shared = [rng.randrange(2, 500) for _ in range(40)]
    histories: list[list[int]] = []  # finished conversations: a next turn hits blocks filled by decodes
    fast_decodes = num_preempted = num_finished = 0
    for step in range(300):
        if step < 120 and rng.random() < 0.4:
            head = rng.choice(histories) if histories and rng.random() < 0.5 else shared[: rng.randrange(0, 40)]
            prompt = head + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 30))]
            max_tokens = rng.randrange(1, 50)
            for sched in twins:
                sched.add_request(Request(f"r{step}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)))
        fast = twins[0].kv.append_slots(twins[0].running)
        fast_decodes += sum(ids is not None for ids in fast)
        outs = [sched.schedule() for sched in twins]
        assert plan_of(outs[0]) == plan_of(outs[1]), f"step {step}"
        assert twins[0].kv.pool.cached.keys() == twins[1].kv.pool.cached.keys(), f"step {step}"
        num_preempted += len(outs[0].preempted)
        token = rng.randrange(2, 500)
        for sched, out in zip(twins, outs):
            for s in out.scheduled:
                if s.samples:
                    s.request.append_token(token)
                    if s.request.num_output_tokens >= s.request.params.max_tokens:
                        sched.finish(s.request, RequestStatus.FINISHED_LENGTH)
                        num_finished += 1
                        if sched is twins[0]:
                            histories.append(list(s.request.all_token_ids))
    enough_finished = 80 if budget == 64 else 40  # a small budget serves fewer in 300 steps
    assert fast_decodes > (500 if budget == 64 else 300) and num_preempted > 0 and num_finished > enough_finished, \
        (fast_decodes, num_preempted, num_finished)
    if enable_caching:
        assert twins[0].stats.prefix_cache_hits > 0


def test_decodes_past_the_budget_wait_as_they_do_on_the_general_path():
    # In steady FIFO the running requests fit the budget (they were admitted
    # under it), so the budget is lowered once all ten run.
    config = SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=10)
    twins = [Scheduler(config, CacheConfig(), cls(num_blocks=64, block_size=16))
             for cls in (KVCacheManager, GeneralPathOnly)]
    for i in range(10):
        for sched in twins:
            sched.add_request(Request(f"r{i}", [5 + i, 6], SamplingParams(max_tokens=12, temperature=0)))
    cut_runs = 0
    for step in range(60):
        if step == 2:
            config.max_num_batched_tokens = 4
        running_decodes = sum(ids is not None for ids in twins[0].kv.append_slots(twins[0].running))
        outs = [sched.schedule() for sched in twins]
        assert plan_of(outs[0]) == plan_of(outs[1]), f"step {step}"
        cut_runs += running_decodes > 4 and len(outs[0].scheduled) == 4
        for sched, out in zip(twins, outs):
            for s in out.scheduled:
                if s.samples:
                    s.request.append_token(7)
                    if s.request.num_output_tokens >= s.request.params.max_tokens:
                        sched.finish(s.request, RequestStatus.FINISHED_LENGTH)
    assert cut_runs > 5, cut_runs


def scheduler_with_one_request(request_id: str, prompt: list[int], max_tokens: int) -> tuple[Scheduler, Request]:
    """A scheduler with blocks of 4 tokens, serving one greedy request."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(),
                      KVCacheManager(num_blocks=16, block_size=4))
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    sched.add_request(request)
    return sched, request


def test_a_block_filled_by_decodes_is_named_at_its_next_block_or_when_the_request_ends():
    sched, request = scheduler_with_one_request("a", [11, 12, 13], max_tokens=20)
    named = []
    for token in range(21, 27):  # computes tokens 0-2 (a prefill), then 3, 4, 5, 6 and 7
        sched.schedule()
        request.append_token(token)
        named.append(len(sched.kv.pool.cached))
    # Block 0 fills at the second step, on the fast path; it is named at the
    # third, whose token needs block 1. Block 1 fills at the last step.
    assert named == [0, 0, 1, 1, 1, 1]
    sched.finish(request, RequestStatus.FINISHED_STOPPED)
    assert len(sched.kv.pool.cached) == 2  # named as its blocks went back
    follow_up = Request("b", request.all_token_ids[:8] + [99], SamplingParams(max_tokens=1))
    assert sched.kv.get_computed_blocks(follow_up)[1] == 8


def test_decode_entries_are_reused_and_a_finished_request_needs_no_cycle_collector():
    # The scheduler reuses one plan entry per request for its decode steps; the
    # entry refers back to the request, so finish() must break that cycle or
    # every finished request waits for the cycle collector (memory held, GC pauses).
    sched, request = scheduler_with_one_request("r", [3, 4, 5], max_tokens=10)
    entries = []
    for _ in range(6):
        out = sched.schedule()
        entries.append(out.scheduled[0])
        request.append_token(7)
    assert entries[0] is not entries[1] and all(e is entries[1] for e in entries[1:])  # prefill, then decodes
    assert entries[-1].start == 7 and out.num_plain_decodes == 1
    alive = weakref.ref(request)
    gc.disable()
    try:
        sched.finish(request, RequestStatus.FINISHED_LENGTH)
        del request, out, entries
        assert alive() is None
    finally:
        gc.enable()
