"""The scheduler's side of the host KV tier (host_kv_tier.py): preemption by
swapping, prefix-cache blocks kept on the host when the device evicts them,
and restoring either instead of recomputing.

What it decides, all on the engine thread while the scheduler plans; the
copies go into the plan (SchedulerOutput.swap_out / swap_in) and the runner
makes them before the step's forward, every swap-out before any swap-in:
- swap_out(victim): a preempted request's computed blocks are copied to host
  slots it references until it resumes or leaves. Every computed block is
  copied, shared ones too: a block another request holds now may be evicted
  from the device before this one comes back, and the copy is what makes the
  resume independent of that. A full block whose hash a slot already names is
  not copied again: the request references that slot. The last, partial
  block gets an anonymous slot. No room for all of them: nothing is copied
  and the request is recomputed, as without the tier.
- restorable(request, device_hits): at admission, what the host adds after
  the leading blocks the device cache still has (those are used from there,
  shared, never swapped in): a swapped-out request's own slots, or, for any
  other request, slots found by the chained hashes of its next full blocks.
  The request's tokens then count as computed once restore() plans the
  swap-ins into its newly allocated blocks.
- offload (BlockPool.on_evict): a cached full block the device evicts to
  make room is copied to a slot named by its hash (the LRU's oldest host
  entry makes way; a tier whose slots are all referenced keeps nothing).

Swapping is chosen whenever the tier has room: copying a block over PCIe
moves its bytes once, recomputing it runs the whole model over its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from tandem.engine.block_pool import KVCacheBlock
from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.plan import SchedulerOutput
from tandem.engine.request import Request


@dataclass
class SwapStats:
    swapped_out_blocks: int = 0  # preempted requests' blocks copied to the host
    swapped_in_blocks: int = 0  # ... and copied back when they resumed
    offloaded_blocks: int = 0  # cached blocks the device evicted, kept on the host
    host_hit_blocks: int = 0  # prompt blocks restored from the host by their hash


@dataclass
class HostRestore:
    """What the host tier gives a request at admission: slots for its blocks
    from index `first_block` on, worth num_tokens tokens."""

    first_block: int = 0
    slots: list[int] = field(default_factory=list)
    num_tokens: int = 0
    swapped: bool = False  # the request's own swapped-out blocks (not hash hits)


NO_RESTORE = HostRestore()


class KVSwapper:
    def __init__(self, tier: HostKVTier, kv: KVCacheManager) -> None:
        self.tier = tier
        self.kv = kv
        self.block_size = kv.block_size
        self.stats = SwapStats()
        self._swap_out: list[tuple[int, int]] = []  # this plan's copies, until flush()
        self._swap_in: list[tuple[int, int]] = []
        if kv.enable_caching:
            kv.pool.on_evict = self._offload

    def flush(self, out: SchedulerOutput) -> None:
        """Hand the plan its copies; the plan is complete."""
        out.swap_out, self._swap_out = self._swap_out, []
        out.swap_in, self._swap_in = self._swap_in, []
        self.tier.end_plan()

    # ---- preemption --------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Plan the copy of a preempted request's computed blocks to the host;
        False (nothing planned) when the tier lacks room. Call before its
        device blocks are freed."""
        num_tokens = request.num_computed_tokens
        num_blocks = min(-(-num_tokens // self.block_size), len(request.blocks))
        if num_blocks == 0:
            return False
        tier = self.tier
        hashes = self.kv.block_hashes(request) if self.kv.enable_caching else []
        num_full = min(num_tokens // self.block_size, len(hashes))
        known = [tier.lookup(hashes[i]) if i < num_full else None for i in range(num_blocks)]
        # A named slot nobody references is both a hit and evictable: counted once.
        num_known_evictable = sum(1 for s in set(known) if s is not None and tier.ref_cnt[s] == 0)
        num_missing = sum(1 for s in known if s is None)
        if tier.num_allocatable - num_known_evictable < num_missing:
            return False
        for slot in known:
            if slot is not None:
                tier.ref(slot)  # before allocate() below can evict it
        slots = []
        for i, slot in enumerate(known):
            if slot is None:
                slot = tier.allocate(hashes[i] if i < num_full else None)
                self._swap_out.append((request.block_ids[i], slot))
                self.stats.swapped_out_blocks += 1
            slots.append(slot)
        request.host_slots, request.num_host_tokens = slots, num_tokens
        return True

    def release(self, request: Request) -> None:
        """A swapped-out request leaves (finished or aborted while waiting)."""
        for slot in request.host_slots:
            self.tier.unref(slot)
        request.host_slots, request.num_host_tokens = [], 0

    # ---- admission ---------------------------------------------------
    def restorable(self, request: Request, device_hits: Sequence[KVCacheBlock]) -> HostRestore:
        """What the host adds after the device's leading hits. The slots are
        referenced until the plan is complete, so nothing planned after this
        call (an eviction while allocating, another preemption) overwrites them."""
        bs, tier, first = self.block_size, self.tier, len(device_hits)
        if request.host_slots:
            num_tokens = request.num_host_tokens - first * bs
            if num_tokens <= 0:
                return HostRestore(first, [], 0, swapped=True)  # the device still has them all
            slots = request.host_slots[first:]
            swapped = True
        else:
            if not self.kv.enable_caching:
                return NO_RESTORE
            hashes = request.block_hashes  # brought up to date by get_computed_blocks
            max_blocks = (request.num_tokens - 1) // bs  # the last token is always computed
            slots = []
            for block_hash in hashes[first:max_blocks]:
                slot = tier.lookup(block_hash)
                if slot is None:
                    break
                slots.append(slot)
            if not slots:
                return NO_RESTORE
            num_tokens, swapped = len(slots) * bs, False
        for slot in slots:
            tier.ref_for_plan(slot)
        return HostRestore(first, slots, num_tokens, swapped)

    def restore(self, request: Request, host: HostRestore) -> None:
        """The request got its device blocks: plan the swap-ins into them."""
        blocks = request.block_ids[host.first_block:host.first_block + len(host.slots)]
        self._swap_in.extend(zip(host.slots, blocks))
        if host.swapped:
            self.stats.swapped_in_blocks += len(host.slots)
            self.release(request)
        else:
            self.stats.host_hit_blocks += len(host.slots)

    # ---- device evictions ----------------------------------------------
    def _offload(self, block: KVCacheBlock) -> None:
        """BlockPool.on_evict: keep the evicted cached block on the host."""
        slot = self.tier.lookup(block.block_hash)
        if slot is not None:
            if self.tier.ref_cnt[slot] == 0:
                self.tier.lru.move_to_end(slot)  # used again: last to be evicted
            return
        slot = self.tier.allocate(block.block_hash)
        if slot is None:
            return  # every slot is referenced: the block is lost, as without the tier
        self.tier.unref(slot)  # a cache entry: nobody holds it, it waits in the LRU
        self._swap_out.append((block.block_id, slot))
        self.stats.offloaded_blocks += 1
