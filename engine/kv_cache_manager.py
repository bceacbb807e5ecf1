"""A request's KV blocks on top of the block pool: prefix-cache lookup,
on-demand allocation (one partial block per sequence at most), naming full
blocks for the prefix cache, and freeing.

The per-request state lives on the Request (`blocks`, `block_ids`,
`num_named_blocks`, `block_hashes`); this class holds none, so a request is
freed by one call and nothing keyed by its id is left behind.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tandem.engine.block_hash import extend_block_hashes
from tandem.engine.block_pool import BlockHash, BlockPool, KVCacheBlock
from tandem.engine.request import Request

# allocate_slots' answer when the step needs no new block: shared, never mutated.
NO_NEW_BLOCKS: list[KVCacheBlock] = []


class KVCacheManager:
    # allocate_slots answers a decode into a slot it holds before any
    # arithmetic (most decode steps). Tests turn it off to check the shortcut
    # plans exactly what the general path plans.
    decode_shortcut = True

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes = b"") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra  # e.g. the model id: blocks of different models never match
        self.pool = BlockPool(num_blocks, enable_caching)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """request.block_hashes, extended to every full block of its tokens so far."""
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                   self.hash_extra)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of leading blocks already in the cache, and their token count.

        At least one token is always left to compute: the last one's logits are
        needed to sample. Also brings request.block_hashes up to date.
        """
        hashes = self.block_hashes(request)
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_external_tokens: int = 0) -> Optional[list[KVCacheBlock]]:
        """Make room for the tokens this step computes (or loads); returns the
        blocks added to request.blocks (hits first, then fresh ones), or None
        when blocks run out (nothing changed then).

        new_computed_blocks are local prefix-cache hits (the caller counts them
        in request.num_computed_tokens only after success); num_external_tokens
        arrive through the KV connector into fresh blocks.
        """
        bs = self.block_size
        computed = request.num_computed_tokens
        # A decode names only blocks already computed: the one it fills is named
        # at its next step, whose token needs a new block (or when the request
        # is freed). Only later requests (a next turn) share such a block, and
        # they find it either way. A prompt chunk names what it fills: a request
        # scheduled in the same step may hit those blocks (every layer writes
        # the whole batch's K/V before attention reads it).
        decode = num_new_tokens == 1 and not new_computed_blocks and not num_external_tokens
        if (decode and computed < len(request.block_ids) * bs and self.decode_shortcut
                and (computed // bs <= request.num_named_blocks or not self.enable_caching)):
            return NO_NEW_BLOCKS  # most decode steps: a slot it holds, nothing became full
        total = computed + num_new_tokens
        hit_blocks = list(new_computed_blocks)
        total += len(hit_blocks) * bs + num_external_tokens
        num_needed = -(-total // bs) - len(request.blocks) - len(hit_blocks)
        # Hit blocks that are free leave the free queue when touched.
        num_hits_in_free_queue = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_hits_in_free_queue:
            return None
        if hit_blocks:
            self.pool.touch(hit_blocks)
        added = hit_blocks + (self.pool.allocate(num_needed) if num_needed > 0 else [])
        if added:
            request.blocks.extend(added)
            request.block_ids.extend([b.block_id for b in added])
        self._name_full_blocks(request, computed if decode else min(total, request.num_tokens))
        return added

    def _name_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the request's blocks that are full within its first num_tokens
        tokens by their chained hashes, so later requests can hit them."""
        if not self.enable_caching or num_tokens // self.block_size <= request.num_named_blocks:
            return
        hashes = self.block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes), len(request.blocks))
        blocks = request.blocks
        for i in range(request.num_named_blocks, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        request.num_named_blocks = max(request.num_named_blocks, num_full)

    def free(self, request: Request) -> None:
        """Give the request's blocks back; full blocks it computed stay findable
        (named here if a decode filled them since its last allocation). Its
        block table starts over as new lists: the runner's row was written
        from the old ones."""
        blocks = request.blocks
        if blocks:
            self._name_full_blocks(request, request.num_computed_tokens)
            self.pool.free(reversed(blocks))
        request.blocks, request.block_ids, request.num_named_blocks = [], [], 0

    def hold(self, request: Request, num_blocks: int) -> list[KVCacheBlock]:
        """One more reference on each of the request's first num_blocks blocks,
        so they outlive its free(): a producer keeps a finished prompt's blocks
        for a consumer to copy. Give them back with release()."""
        blocks = request.blocks[:num_blocks]
        self.pool.touch(blocks)
        return blocks

    def release(self, blocks: list[KVCacheBlock]) -> None:
        self.pool.free(reversed(blocks))

    @property
    def usage(self) -> float:
        return self.pool.usage()
