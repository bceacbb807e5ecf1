"""The scheduler settles most decodes through KVCacheManager.append_slots
without the general path's bookkeeping. It must plan exactly what the general
path plans: two schedulers, one with the fast path switched off, fed the same
requests and tokens, make the same plan every step, through block boundaries,
prefix-cache naming, preemption and finished requests, under both policies."""
import random

import pytest

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler


class GeneralPathOnly(KVCacheManager):
    def append_slots(self, requests):
        return [None] * len(requests)


def plan_of(out):
    return ([(s.request.request_id, s.start, s.num_new_tokens, list(s.block_ids)) for s in out.scheduled],
            [r.request_id for r in out.preempted])


@pytest.mark.parametrize("policy", ["fifo", "srtf"])
@pytest.mark.parametrize("enable_caching", [True, False])
def test_fast_path_plans_what_the_general_path_plans(policy, enable_caching):
    rng = random.Random(1)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=12, policy=policy)
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
    assert fast_decodes > 500 and num_preempted > 0 and num_finished > 80, (fast_decodes, num_preempted, num_finished)
    if enable_caching:
        assert twins[0].stats.prefix_cache_hits > 0
