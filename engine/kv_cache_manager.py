"""Per-request block tables on top of the block pool: prefix-cache lookup,
on-demand allocation (one partial block per sequence at most), and freeing."""
from __future__ import annotations

from typing import Optional

from tandem.engine.block_hash import extend_block_hashes
from tandem.engine.block_pool import BlockHash, BlockPool, KVCacheBlock
from tandem.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes = b"") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra  # e.g. the model id: blocks of different models never match
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The block table of each request as plain ids, kept in step with
        # req_to_blocks (appended on allocation) so a step never rebuilds it.
        self._block_ids: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a request already named in the pool
        self._hashes: dict[str, list[BlockHash]] = {}

    def block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_block_hashes(hashes, request.all_token_ids, self.block_size, self.hash_extra)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of leading blocks already in the cache, and their token count.

        At least one token is always left to compute: the last one's logits are
        needed to sample.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def append_slots(self, requests: list[Request]) -> list[Optional[list[int]]]:
        """The decode fast path, for a whole batch: per request, its block table
        when its next step is a decode into a slot it already holds (so
        allocate_slots(request, 1) would allocate and name nothing), else None:
        the general path must run. Changes nothing. Most decode steps end here.
        (A plain loop: at batch 256, numpy over attributes gathered with map()
        took twice as long.)"""
        bs = self.block_size
        ids_of = self._block_ids
        out: list[Optional[list[int]]] = []
        for request in requests:
            total = request.num_computed_tokens + 1
            ids = ids_of.get(request.request_id)
            if ids is None or len(request.all_token_ids) != total or total > len(ids) * bs:
                ids = None
            out.append(ids)
        return out

    def append_block(self, request: Request) -> Optional[list[int]]:
        """The common case of the general path at large batch: a decode whose
        token starts a new block. Does what allocate_slots(request, 1) does
        there (one block from the free queue; blocks already computed are
        named) without its arithmetic, and returns the block table. None when
        the request is not such a decode or no block is free (the caller falls
        back to allocate_slots, and preemption)."""
        ids = self._block_ids.get(request.request_id)
        total = request.num_computed_tokens + 1
        if (ids is None or len(request.all_token_ids) != total or total != len(ids) * self.block_size + 1
                or not self.pool.free_queue):
            return None
        block = self.pool.allocate(1)[0]
        blocks = self.req_to_blocks[request.request_id]
        blocks.append(block)
        ids.append(block.block_id)
        self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        return ids

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None,
                       num_external_tokens: int = 0) -> Optional[list[KVCacheBlock]]:
        """Make room for the tokens this step computes (or loads); None if blocks run out.

        new_computed_blocks are local prefix-cache hits (already counted in
        request.num_computed_tokens by the caller only after success);
        num_external_tokens arrive through the KV connector into fresh blocks.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_external_tokens + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        if new_computed_blocks:
            # Hit blocks that are free leave the free queue when touched.
            num_hits_in_free_queue = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_needed > self.pool.num_free_blocks - num_hits_in_free_queue:
                return None
            self.pool.touch(new_computed_blocks)
        elif num_needed > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(num_needed) if num_needed > 0 else []
        ids = self._block_ids.setdefault(request.request_id, [])
        for added in (new_computed_blocks, new_blocks):
            if added:
                blocks.extend(added)
                ids.extend([b.block_id for b in added])
        # A decode names only blocks already computed: the one it fills is named
        # at its next step, whose token needs a new block (or when the request
        # is freed), so the step that fills a block stays on the fast path. Only
        # later requests (a next turn) share such a block, and they find it
        # either way. A prompt chunk names what it fills (_cache_full_blocks).
        decode = num_new_tokens == 1 and not new_computed_blocks and not num_external_tokens
        named = request.num_computed_tokens if decode else min(total, request.num_tokens)
        self._cache_full_blocks(request, blocks, named)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # A prompt chunk's blocks are named as soon as they will be full after
        # this step: a request scheduled in the same step reads them after this
        # step's K/V writes (every layer writes the whole batch's K/V before attention).
        if not self.enable_caching:
            return
        start = self._num_hashed.get(request.request_id, 0)
        if num_tokens // self.block_size <= start:
            return  # the common decode step: no block became full
        hashes = self.block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes))
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_hashed[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Give the request's blocks back; full blocks it computed stay findable
        (named here if a decode filled them since its last allocation)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if blocks:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        self._block_ids.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        self._num_hashed.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drop per-request bookkeeping once the request is gone for good."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (a live list: read it, do not keep it across steps)."""
        return self._block_ids.get(request.request_id, [])

    @property
    def usage(self) -> float:
        return self.pool.usage()
