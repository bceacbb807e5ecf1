"""The engine-local host-memory KV tier: a bounded set of block slots in host
memory, below the device cache.

Two halves, split as the scheduler and the runner are:
- HostKVTier (scheduler side, plain Python): which slot holds what. A slot
  holds one block of every layer. It is findable by the block's chained hash
  when its content is a full block, and it is referenced by the swapped-out
  requests whose blocks it holds and by this step's swap-ins that read it.
- HostKVBuffer (runner side): the one preallocated tensor of slots (pinned
  when CUDA is available, so copies to and from the GPU are DMA) and the
  copies a plan asks for.

Invariants of HostKVTier:
- ref_cnt[s] == 0 exactly when slot s is in `free` (no content anyone wants)
  or in `lru` (named by a hash, kept as a cache, evictable).
- A slot with ref_cnt > 0 is never handed out again: a swapped-out request's
  slots stay until it resumes or leaves, and a slot read by a swap-in of the
  plan being built stays until that plan is complete (end_plan), so no copy
  of the same plan overwrites what its swap-ins read. Once the plan is handed
  over, that no longer matters: a later plan's copies run after its copies.
- by_hash[h] == s exactly when hash_of[s] == h; a slot is named only by the
  hash of a full block whose copy into it is planned in this step or earlier.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # the scheduler imports this module and stays free of torch
    import torch

BlockHash = bytes


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.ref_cnt = [0] * num_slots
        self.hash_of: list[Optional[BlockHash]] = [None] * num_slots
        self.by_hash: dict[BlockHash, int] = {}
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        # Named slots nobody references, least recently used first (evicted first).
        self.lru: OrderedDict[int, None] = OrderedDict()
        self._plan_refs: list[int] = []  # what the plan being built reads, until end_plan
        self.num_evictions = 0

    @property
    def num_allocatable(self) -> int:
        """Slots allocate() can hand out now: free ones and evictable cached ones."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    def lookup(self, block_hash: BlockHash) -> Optional[int]:
        return self.by_hash.get(block_hash)

    def allocate(self, block_hash: Optional[BlockHash] = None) -> Optional[int]:
        """A slot with one reference (the caller's), named block_hash if given;
        None when every slot is referenced. A free slot is taken before the
        least recently used cached one is evicted."""
        if self.free:
            slot = self.free.pop()
        elif self.lru:
            slot, _ = self.lru.popitem(last=False)
            del self.by_hash[self.hash_of[slot]]
            self.hash_of[slot] = None
            self.num_evictions += 1
        else:
            return None
        self.ref_cnt[slot] = 1
        if block_hash is not None and block_hash not in self.by_hash:
            self.hash_of[slot] = block_hash
            self.by_hash[block_hash] = slot
        return slot

    def ref(self, slot: int) -> None:
        if self.ref_cnt[slot] == 0:
            del self.lru[slot]  # referenced slots are never evictable
        self.ref_cnt[slot] += 1

    def unref(self, slot: int) -> None:
        if self.ref_cnt[slot] <= 0:
            raise AssertionError(f"host slot {slot} released more often than referenced")
        self.ref_cnt[slot] -= 1
        if self.ref_cnt[slot] == 0:
            if self.hash_of[slot] is not None:
                self.lru[slot] = None  # most recently used end
            else:
                self.free.append(slot)

    def ref_for_plan(self, slot: int) -> None:
        """A reference that lasts until end_plan(): the plan being built reads the slot."""
        self.ref(slot)
        self._plan_refs.append(slot)

    def end_plan(self) -> None:
        """The plan is complete; its copies run before any later plan's."""
        refs, self._plan_refs = self._plan_refs, []
        for slot in refs:
            self.unref(slot)


class HostKVBuffer:
    """The tier's memory: [num_slots, num_layers, 2, block_size, kv_heads, head_dim],
    a slot contiguous (one DMA per block). The device cache is
    [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, num_slots: int, device_cache_shape: Sequence[int], dtype: torch.dtype,
                 pin: bool) -> None:
        import torch

        num_layers, two, _, block_size, num_heads, head_dim = device_cache_shape
        shape = (num_slots, num_layers, two, block_size, num_heads, head_dim)
        self.slots = torch.empty(shape, dtype=dtype, pin_memory=pin)

    def copy(self, kv_cache: torch.Tensor, swap_out: Sequence[tuple[int, int]],
             swap_in: Sequence[tuple[int, int]]) -> None:
        """Every swap-out (device block -> slot) before any swap-in (slot ->
        device block): a device block freed by one request and handed to
        another in the same step is read before it is overwritten. The
        scheduler keeps the other order safe (a slot read this step is not
        written this step)."""
        import torch

        with torch.inference_mode():
            self._copy(torch, kv_cache, swap_out, swap_in)

    def _copy(self, torch, kv_cache, swap_out, swap_in) -> None:
        from tandem.kernels.kv_cache_dtype import movable  # FP8 caches copy as bytes

        if swap_out:
            blocks = torch.tensor([b for b, _ in swap_out], device=kv_cache.device)
            slots = torch.tensor([s for _, s in swap_out])
            gathered = kv_cache.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5)
            movable(self.slots).index_copy_(0, slots, movable(gathered.to("cpu")))
        if swap_in:
            slots = torch.tensor([s for s, _ in swap_in])
            blocks = torch.tensor([b for _, b in swap_in], device=kv_cache.device)
            moved = self.slots.index_select(0, slots).to(kv_cache.device, non_blocking=True)
            movable(kv_cache).index_copy_(2, blocks, movable(moved.permute(1, 2, 0, 3, 4, 5)))
