"""KVCacheManager.allocate_slots answers most decode steps (a slot the
request already holds, no block became full) before any arithmetic. That
shortcut must plan exactly what the general path plans: two schedulers, one
with the shortcut switched off, fed the same requests and tokens, make the
same plan every step, through block boundaries, prefix-cache naming,
preemption and finished requests, under both policies."""
import gc
import random
import weakref

import pytest

from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler


class GeneralPathOnly(KVCacheManager):
    decode_shortcut = False


class CountingShortcuts(KVCacheManager):
    shortcuts = 0

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        added = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        self.shortcuts += added is NO_NEW_BLOCKS
        return added


def plan_of(out):
    return (out.request_ids, out.num_computed_tokens, out.num_new_tokens, out.new_block_ids, out.token_ids,
            out.sampled, out.preempted_request_ids, out.freed_request_ids)


def feed(sched: Scheduler, token: int) -> int:
    """The update step with `token` for every sampling request; returns how many finished."""
    before = len(sched.requests)
    n = len(sched.sampling_requests)
    sched.update([token] * n, [None] * n, {})
    return before - len(sched.requests)


@pytest.mark.parametrize("policy", ["fifo", "srtf"])
@pytest.mark.parametrize("enable_caching", [True, False])
# A budget of 7 tokens: prompts are chunked and running decodes wait their turn.
@pytest.mark.parametrize("budget", [64, 7])
def test_the_decode_shortcut_plans_what_the_general_path_plans(policy, enable_caching, budget):
    rng = random.Random(1)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=12, policy=policy,
                             admission="greedy")  # greedy: preemption happens
    twins = [Scheduler(config, cls(num_blocks=40, block_size=8, enable_caching=enable_caching))
             for cls in (CountingShortcuts, GeneralPathOnly)]
    shared = [rng.randrange(2, 500) for _ in range(40)]
    histories: list[list[int]] = []  # finished conversations: a next turn hits blocks filled by decodes
    num_preempted = num_finished = 0
    for step in range(300):
        if step < 120 and rng.random() < 0.4:
            head = rng.choice(histories) if histories and rng.random() < 0.5 else shared[: rng.randrange(0, 40)]
            prompt = head + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 30))]
            max_tokens = rng.randrange(1, 50)
            for sched in twins:
                sched.add_request(Request(f"r{step}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)))
        outs = [sched.schedule() for sched in twins]
        assert plan_of(outs[0]) == plan_of(outs[1]), f"step {step}"
        assert twins[0].kv.pool.cached.keys() == twins[1].kv.pool.cached.keys(), f"step {step}"
        num_preempted += len(outs[0].preempted_request_ids)
        sampled = list(twins[0].sampling_requests)
        token = rng.randrange(2, 500)
        finished = [feed(sched, token) for sched in twins]
        histories += [list(r.all_token_ids) for r in sampled if r.is_finished]
        assert finished[0] == finished[1]
        num_finished += finished[0]
    shortcuts = twins[0].kv.shortcuts
    enough_finished = 40 if budget == 64 else 20  # a small budget serves fewer in 300 steps
    assert shortcuts > (500 if budget == 64 else 300) and num_preempted > 0 and num_finished > enough_finished, \
        (shortcuts, num_preempted, num_finished)
    if enable_caching:
        assert twins[0].stats.prefix_cache_hits > 0


def test_decodes_past_the_budget_wait_as_they_do_on_the_general_path():
    # In steady FIFO the running requests fit the budget (they were admitted
    # under it), so the budget is lowered once all ten run.
    config = SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=10)
    twins = [Scheduler(config, cls(num_blocks=64, block_size=16)) for cls in (KVCacheManager, GeneralPathOnly)]
    for i in range(10):
        for sched in twins:
            sched.add_request(Request(f"r{i}", [5 + i, 6], SamplingParams(max_tokens=12, temperature=0)))
    cut_runs = 0
    for step in range(60):
        if step == 2:
            config.max_num_batched_tokens = 4
        running = len(twins[0].running)
        outs = [sched.schedule() for sched in twins]
        assert plan_of(outs[0]) == plan_of(outs[1]), f"step {step}"
        cut_runs += running > 4 and outs[0].num_entries == 4
        for sched in twins:
            feed(sched, 7)
    assert cut_runs > 5, cut_runs


def scheduler_with_one_request(request_id: str, prompt: list[int], max_tokens: int) -> tuple[Scheduler, Request]:
    """A scheduler with blocks of 4 tokens, serving one greedy request."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                      KVCacheManager(num_blocks=16, block_size=4))
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    sched.add_request(request)
    return sched, request


def test_a_block_filled_by_decodes_is_named_at_its_next_block_or_when_the_request_ends():
    sched, request = scheduler_with_one_request("a", [11, 12, 13], max_tokens=20)
    named = []
    for token in range(21, 27):  # computes tokens 0-2 (a prefill), then 3, 4, 5, 6 and 7
        sched.schedule()
        sched.update([token], [None], {})
        named.append(len(sched.kv.pool.cached))
    # Block 0 fills at the second step, by the shortcut; it is named at the
    # third, whose token needs block 1. Block 1 fills at the last step.
    assert named == [0, 0, 1, 1, 1, 1]
    history = list(request.all_token_ids)
    sched.finish(request, RequestStatus.FINISHED_STOPPED)
    assert len(sched.kv.pool.cached) == 2  # named as its blocks went back
    follow_up = Request("b", history[:8] + [99], SamplingParams(max_tokens=1))
    assert sched.kv.get_computed_blocks(follow_up)[1] == 8


def test_a_finished_request_leaves_nothing_behind():
    # One call lets a request go: no queue, dict or cycle keeps it alive (no
    # cycle collector needed), and the next plan tells the runner to drop its row.
    sched, request = scheduler_with_one_request("r", [3, 4, 5], max_tokens=4)
    for _ in range(4):
        sched.schedule()
        sched.update([7], [None], {})
    assert request.is_finished and not sched.has_unfinished()
    assert request.blocks == [] and request.block_ids == []
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    alive = weakref.ref(request)
    gc.disable()
    try:
        del request
        assert alive() is None
    finally:
        gc.enable()
    assert sched.schedule().freed_request_ids == ["r"]
