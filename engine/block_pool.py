"""Fixed-size KV blocks: the free queue, reference counts and the prefix-cache map.

Invariants:
- ref_cnt == 0 exactly when the block is in the free queue.
- A free block keeps its hash (and stays findable in `cached`) until it is
  handed out again: freeing does not evict, reallocation does. The free queue
  is LRU, so the least recently freed cached block is evicted first.
- Block 0 is never handed out: padding slots may point at it harmlessly.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

BlockHash = bytes


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # OrderedDict as a doubly linked list: O(1) append, pop-oldest and removal
        # from the middle (a cache hit on a free block takes it out of the queue).
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # Called with each cached block as it is evicted, its hash and content
        # still intact (the host KV tier copies it before the block is reused).
        self.on_evict: Optional[Callable[[KVCacheBlock], None]] = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue (LRU), evicting their cached hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. Callers pass a request's blocks in reverse
        order, so the tail of a sequence (least likely to be shared) is evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Name a full block by its chained hash so later requests can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds this content; keep the first
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

