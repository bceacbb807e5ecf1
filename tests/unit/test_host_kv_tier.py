"""The host KV tier: its slot index (bounds, LRU by hash, referenced slots),
its copies on real tensors, and the scheduler's swapping driven step by step
without a model (the real scheduler, KV cache manager and tier)."""
import itertools

import pytest
import torch

from tandem.engine.config import SchedulerConfig
from tandem.engine.host_kv_tier import HostKVBuffer, HostKVTier
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_swapper import KVSwapper
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler

_ids = itertools.count()


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


# ---- the slot index ------------------------------------------------------

def test_tier_is_bounded_and_evicts_the_least_recently_used_cached_slot():
    tier = HostKVTier(3)
    slots = [tier.allocate(h(i)) for i in range(3)]
    for s in slots:
        tier.unref(s)  # cache entries now: findable, evictable
    assert tier.num_allocatable == 3 and tier.num_used == 3
    tier.ref(slots[0])  # used again: no longer evictable
    tier.unref(slots[0])  # ... and now the most recently used
    new = tier.allocate(h(9))
    assert new == slots[1], "the oldest unreferenced entry goes first"
    assert tier.lookup(h(1)) is None and tier.lookup(h(9)) == new
    assert tier.lookup(h(0)) == slots[0] and tier.num_evictions == 1


def test_referenced_slots_are_never_evicted():
    tier = HostKVTier(2)
    a, b = tier.allocate(h(1)), tier.allocate()  # both referenced (a swapped-out request's)
    assert tier.allocate(h(2)) is None and tier.num_allocatable == 0
    tier.unref(b)  # anonymous: straight back to free
    assert tier.allocate(h(3)) == b
    assert tier.lookup(h(1)) == a


def test_a_slot_read_by_the_plan_is_not_handed_out_until_the_plan_is_complete():
    tier = HostKVTier(1)
    slot = tier.allocate(h(1))
    tier.unref(slot)
    tier.ref_for_plan(slot)  # a swap-in of this plan reads it
    assert tier.allocate(h(2)) is None
    tier.end_plan()
    assert tier.allocate(h(2)) == slot


def test_unbalanced_release_is_caught():
    tier = HostKVTier(1)
    slot = tier.allocate()
    tier.unref(slot)
    with pytest.raises(AssertionError):
        tier.unref(slot)


# ---- the copies ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8-kv-cache"])
def test_swap_out_reads_a_block_before_a_swap_in_of_the_same_step_overwrites_it(dtype):
    # FP8 (--kv-cache-dtype fp8): torch's CPU index_copy_ has no FP8 kernel; the tier copies bytes.
    shape = (2, 2, 6, 4, 1, 3)  # layers, K/V, blocks, block size, heads, head dim
    cache = torch.randn(shape).to(dtype)
    buf = HostKVBuffer(4, shape, dtype, pin=False)
    buf.slots[1] = 7.0
    old_block_3 = cache[:, :, 3].to(torch.float32, copy=True)
    buf.copy(cache, swap_out=[(3, 0)], swap_in=[(1, 3)])
    assert torch.equal(buf.slots[0].float(), old_block_3)
    assert torch.equal(cache[:, :, 3].float(), torch.full_like(old_block_3, 7.0))
    untouched = cache.to(torch.float32, copy=True)
    buf.copy(cache, swap_out=[], swap_in=[(0, 5)])  # and back, into another block
    assert torch.equal(cache[:, :, 5].float(), old_block_3)
    assert torch.equal(cache[:, :, :5].float(), untouched[:, :, :5])


# ---- the scheduler, swapping -----------------------------------------------

def make(num_blocks: int, num_slots: int, budget: int = 256):
    kv = KVCacheManager(num_blocks, 16, True)
    swapper = KVSwapper(HostKVTier(num_slots), kv)
    # Greedy admission: these tests need requests preempted (swapped out).
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, admission="greedy"), kv, swapper=swapper)


def request(n_prompt: int, max_tokens: int) -> Request:
    base = next(_ids) * 1000
    return Request(f"r{next(_ids)}", [base % 997 + i + 2 for i in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, temperature=0))


def run(sched: Scheduler, limit: int = 500):
    """Step until done; yields each plan (its tokens sampled as 7)."""
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        plan = sched.schedule()
        yield plan
        n = len(sched.sampling_requests)
        sched.update([7] * n, [None] * n, {})
    raise AssertionError("requests did not finish")


def test_preempted_request_swaps_out_and_resumes_where_it_stopped():
    sched = make(num_blocks=12, num_slots=32)  # 11 usable device blocks
    reqs = [request(40, max_tokens=30) for _ in range(3)]  # 3 blocks each to start, 5 at the end
    for r in reqs:
        sched.add_request(r)
    swapped: dict[str, tuple[int, list[int]]] = {}  # request id -> (tokens kept, its device blocks)
    resumed = 0
    for plan in run(sched):
        for i, request_id in enumerate(plan.request_ids):
            if request_id in swapped:  # its first entry after the preemption
                kept, _ = swapped.pop(request_id)
                assert plan.num_computed_tokens[i] == kept, "resumed where it stopped, nothing recomputed"
                new_blocks = plan.new_block_ids[i]
                restored = {dst for _, dst in plan.swap_in}
                assert restored <= set(new_blocks)
                resumed += 1
        for request_id in plan.preempted_request_ids:
            victim = sched.requests[request_id]
            assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert victim.host_slots and victim.num_host_tokens > 0
            copied = [b for b, _ in plan.swap_out]
            assert copied, "the victim's blocks are copied in the plan that preempts it"
            swapped[request_id] = (victim.num_host_tokens, copied)
    assert resumed > 0, "the cache was sized to force preemption"
    stats = sched.swapper.stats
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0
    assert sched.stats.num_preemptions == resumed
    assert all(r.num_output_tokens == 30 for r in reqs)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert all(c == 0 for c in sched.swapper.tier.ref_cnt), "every slot is let go"


def test_a_tier_without_room_falls_back_to_recompute():
    sched = make(num_blocks=12, num_slots=1)  # a victim holds 3 blocks or more
    reqs = [request(40, max_tokens=30) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    for plan in run(sched):  # (the one slot may still cache an evicted block, restored by hash)
        for request_id in plan.preempted_request_ids:
            assert not sched.requests[request_id].host_slots
    assert sched.stats.num_preemptions > 0
    assert sched.swapper.stats.swapped_out_blocks == sched.swapper.stats.swapped_in_blocks == 0
    assert all(r.num_output_tokens == 30 for r in reqs)


def test_aborting_a_swapped_out_request_gives_its_slots_back():
    sched = make(num_blocks=12, num_slots=32)
    reqs = [request(40, max_tokens=30) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    for plan in run(sched):
        if plan.preempted_request_ids:
            victim = sched.requests[plan.preempted_request_ids[0]]
            assert victim.host_slots
            sched.abort(victim.request_id)
            assert not victim.host_slots
            break
    tier = sched.swapper.tier
    for r in reqs:
        sched.abort(r.request_id)
    assert all(c == 0 for c in tier.ref_cnt) and tier.num_allocatable == tier.num_slots


def test_evicted_prefix_blocks_are_restored_from_the_tier_by_hash():
    sched = make(num_blocks=8, num_slots=16)  # 7 usable device blocks
    prefix = [3 + i for i in range(64)]  # 4 full blocks
    a = Request("a", prefix + [1], SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(a)
    list(run(sched))
    filler = request(100, max_tokens=1)  # 7 blocks: evicts every cached block of a
    sched.add_request(filler)
    plans = list(run(sched))
    assert sum(len(p.swap_out) for p in plans) >= 4, "the evicted blocks are copied to the host"
    b = Request("b", prefix + [2, 2], SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(b)
    plan = next(run(sched))
    assert plan.num_computed_tokens == [64], "the prefix is not computed again"
    assert len(plan.swap_in) == 4 and [dst for _, dst in plan.swap_in] == plan.new_block_ids[0][:4]
    assert b.num_cached_tokens == 64 and sched.swapper.stats.host_hit_blocks == 4
