"""The store connector: KV blocks in a KVStore, which the engine role injects
(its client of tandem's KV store service).

Store keys are "<chained block hash hex>/<layer>", so a block saved by any
prefill instance is a prefix-cache hit for every decode (and prefill)
instance. A block counts as present when its last layer is: layers are saved
in order, so the last one arriving means the whole block did.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from tandem.engine.connector.base import ConnectorMeta, KVCacheLayout, KVConnector, KVStore
from tandem.engine.connector.serialization import decode_blocks_into, encode_block

log = logging.getLogger(__name__)


def block_key(block_hash: bytes, layer: int) -> str:
    return f"{block_hash.hex()}/{layer}"


@dataclass
class Prefetched:
    """What a background fetch found for one request: the leading run of its
    blocks the store held, from block index `first_block` on, decoded on the
    CPU (layers[l]: [n, 2, block_size, kv_heads, head_dim]). `failure` names
    the step that failed (lookup or load), if one did; it is counted once, on
    the engine thread, when the scheduler reads the result."""

    first_block: int
    hashes: list[bytes] = field(default_factory=list)
    layers: list[torch.Tensor] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0
    failure: Optional[str] = None
    counted: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


@dataclass
class StoreLoad:
    """Blocks to copy into this engine's cache: from `prefetched` (a
    background fetch, from its block `offset` on) or, when None, fetched
    from the store inside the step."""

    request_id: str
    block_ids: list[int]  # where they go in this engine's cache
    block_hashes: list[bytes]
    prefetched: Optional[Prefetched] = None
    offset: int = 0


@dataclass
class StoreSave:
    """Prompt blocks that are full after this step: put every layer of them."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class StoreMeta(ConnectorMeta):
    loads: list[StoreLoad] = field(default_factory=list)
    saves: list[StoreSave] = field(default_factory=list)


class KVStoreConnector(KVConnector):
    def __init__(self, role: str, layout: KVCacheLayout, store: KVStore) -> None:
        super().__init__(role, layout)
        self.client = store
        self.block_size = layout.block_size
        self.num_layers = layout.num_layers
        # Background fetches (decode and prefill alike): request id -> future of Prefetched.
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-prefetch")
        self._prefetches: dict[str, Future] = {}
        # Loads of requests admitted by the schedule() under way: build_meta moves them into the meta.
        self._admitted: list[StoreLoad] = []
        # One thread: layers are put in order, which the presence rule relies on.
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-save")
        self._saves: list[Future] = []
        self._save_started = 0.0

    # ---- scheduler side ------------------------------------------------
    def prefetch(self, request, num_local_hit_tokens: int) -> None:
        """Look up and fetch the request's stored blocks on a loader thread, so
        the step that admits it copies from memory instead of waiting on the
        store while every running request waits too."""
        if not self.consumes:
            return
        first = num_local_hit_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # leave one token to compute
        if last > first:
            self._prefetches[request.request_id] = self._loader.submit(
                self._fetch, first, list(request.block_hashes[first:last]))

    def is_ready(self, request) -> bool:
        fut = self._prefetches.get(request.request_id)
        return fut is None or fut.done()

    def _num_leading_present(self, candidates: list[bytes]) -> int:
        """How many of `candidates`, from the first on, the store holds (raises
        when the store cannot be asked)."""
        present = self.client.exists([block_key(h, self.num_layers - 1) for h in candidates])
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def _fetch(self, first: int, candidates: list[bytes]) -> Prefetched:
        """Look up the leading run of `candidates` the store holds, then load it."""
        try:
            n = self._num_leading_present(candidates)
        except Exception as exc:
            log.warning("KV store lookup failed, computing locally: %s", exc)
            return Prefetched(first_block=first, failure="lookup")
        if n == 0:
            return Prefetched(first_block=first)
        return self._load(first, candidates[:n])

    def _load(self, first: int, hashes: list[bytes]) -> Prefetched:
        """Every layer of these blocks from the store, decoded on the CPU."""
        started = time.monotonic()
        out = Prefetched(first_block=first)
        try:
            keys = [block_key(h, layer) for layer in range(self.num_layers) for h in hashes]
            payloads = self.client.get(keys)
            if any(p is None for p in payloads):
                raise KeyError("evicted from the store between lookup and load")
            n = len(hashes)
            for layer in range(self.num_layers):
                blocks = torch.empty((n, *self.layout.block_shape), dtype=self.layout.dtype)
                decode_blocks_into(payloads[layer * n:(layer + 1) * n], blocks, layer)
                out.layers.append(blocks)
            out.num_bytes = sum(len(p) for p in payloads)
        except Exception as exc:  # store down, evicted, or a foreign block format
            log.warning("KV load failed, computing locally: %s", exc)
            return Prefetched(first_block=first, failure="load")
        out.hashes = list(hashes)
        out.seconds = time.monotonic() - started
        return out

    def _prefetched(self, request, first: int) -> Optional[Prefetched]:
        """The finished prefetch of `request` when it covers block `first`."""
        fut = self._prefetches.get(request.request_id)
        if fut is None or not fut.done():
            return None
        result: Prefetched = fut.result()
        if not result.counted:
            result.counted = True
            if result.failure == "lookup":
                self.stats.lookup_failures += 1
            elif result.failure == "load":
                self.stats.load_failures += 1
        if result.first_block <= first < result.first_block + result.num_blocks:
            return result
        return None

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens: int) -> int:
        if not self.consumes:
            return 0
        first = num_local_hit_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # leave one token to compute
        fut = self._prefetches.get(request.request_id)
        if fut is not None and fut.done():
            result = self._prefetched(request, first)
            if result is not None:
                return (min(result.first_block + result.num_blocks, last) - first) * self.block_size
            looked = fut.result()
            if looked.failure is not None or looked.first_block <= first:
                # The fetch just asked the store about these blocks (or found it
                # down): compute, do not ask again inside the step.
                return 0
        # No prefetch, or local hits shrank below where it started: ask now.
        candidates = request.block_hashes[first:last]
        if not candidates:
            return 0
        try:
            return self._num_leading_present(candidates) * self.block_size
        except Exception as exc:  # store down: compute locally instead
            self.stats.lookup_failures += 1
            log.warning("KV store lookup failed, computing locally: %s", exc)
            return 0

    def update_state_after_alloc(self, request, block_ids, num_local_hit_tokens, num_external_tokens) -> None:
        first = num_local_hit_tokens // self.block_size
        result = self._prefetched(request, first)
        # Admitted: the prefetch's data is used by this step's load or not at all.
        self._prefetches.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        last = first + num_external_tokens // self.block_size
        load = StoreLoad(request.request_id, list(block_ids[first:last]), request.block_hashes[first:last])
        if result is not None:
            load.prefetched, load.offset = result, first - result.first_block
        self._admitted.append(load)

    def build_meta(self, plan, requests: Mapping) -> StoreMeta:
        meta = StoreMeta(loads=self._admitted)
        self._admitted = []
        if not self.produces:
            return meta
        bs = self.block_size
        for request_id, start, num_new in zip(plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens):
            request = requests[request_id]
            # prompt blocks that become complete in this step
            end = min(start + num_new, request.num_prompt_tokens)
            first, last = start // bs, end // bs
            if last > first:
                meta.saves.append(StoreSave(request_id, request.block_ids[first:last],
                                            request.block_hashes[first:last]))
        return meta

    def request_finished(self, request, block_ids) -> tuple[int, dict]:
        fut = self._prefetches.pop(request.request_id, None)
        if fut is not None:
            fut.cancel()  # a fetch already running finishes; its result is dropped
        return 0, {}

    # ---- worker side ---------------------------------------------------
    def start_load(self, meta: StoreMeta) -> set[str]:
        failed: set[str] = set()
        for load in meta.loads:
            if load.prefetched is None:  # not fetched in the background: fetch now, inside the step
                load.prefetched = self._load(0, load.block_hashes)
                if load.prefetched.failure is not None:
                    failed.add(load.request_id)
                    self.stats.load_failures += 1
                    continue
            self._copy_in(load)
        return failed

    def _copy_in(self, load: StoreLoad) -> None:
        result, offset, k = load.prefetched, load.offset, len(load.block_ids)
        assert result.hashes[offset:offset + k] == load.block_hashes, "prefetch does not match the load"
        cache = self.kv_cache
        ids = torch.tensor(load.block_ids, device=cache.device)
        for layer in range(self.num_layers):
            blocks = result.layers[layer][offset:offset + k].transpose(0, 1)  # [2, k, bs, H, D]
            cache[layer][:, ids] = blocks.to(cache.device, non_blocking=True)
        self.stats.load_blocks += k
        self.stats.load_bytes += result.num_bytes * k // result.num_blocks
        self.stats.load_seconds += result.seconds * k / result.num_blocks

    def save_layer(self, layer: int, meta: StoreMeta) -> None:
        if layer == 0:
            self._save_started = time.monotonic()
        items = []
        for save in meta.saves:
            # Copy now: the encoding runs on the saver thread while later layers compute.
            blocks = self.kv_cache[layer][:, save.block_ids].transpose(0, 1).to("cpu", copy=True)
            items.extend((block_key(h, layer), blocks[j]) for j, h in enumerate(save.block_hashes))
        if items:
            self._saves.append(self._saver.submit(self._put, items, layer))

    def _put(self, items: list[tuple[str, torch.Tensor]], layer: int) -> tuple[int, int]:
        """Store one layer's blocks; returns (bytes, blocks completed by this layer)."""
        encoded = [(key, encode_block(block, layer)) for key, block in items]
        self.client.put(encoded)
        completed = len(items) if layer == self.num_layers - 1 else 0
        return sum(len(v) for _, v in encoded), completed

    def wait_for_save(self) -> None:
        futures, self._saves = self._saves, []
        for fut in futures:
            try:
                num_bytes, completed = fut.result()
                self.stats.save_bytes += num_bytes
                self.stats.save_blocks += completed
            except Exception as exc:  # the decode side will recompute; never fail the request
                self.stats.save_failures += 1
                log.warning("KV save failed: %s", exc)
        if futures:
            self.stats.save_seconds += time.monotonic() - self._save_started

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=True)
        self.client.close()
