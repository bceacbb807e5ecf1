"""Direct KV transfer between a prefill and a decode process on one host.

The prefill engine's cache is shared memory (shared_cache.py), which this
connector allocates (allocate_kv_cache). When a prompt finishes there, the
connector asks the scheduler to hold the request's blocks and describes the
prompt's full blocks in a DirectHandle: the cache's export, the block ids and
their generation counters. The router passes the handle to the decode
engine, whose connector copies those blocks from the mapped cache into blocks
of its own inside the step that admits the request (one device-to-device copy
per layer on a GPU), then checks the generations: a block whose last hold
ended meanwhile may have been handed out again, fails the check, and the
request computes that part itself.

A block's generation grows by one each time the last hold on it ends (the
connector counts its holds per block): while any hold on a block lasts, the
pool cannot hand it out, so an unchanged generation after the copy means the
bytes copied were the prompt's.

The router releases a hold once the decode has streamed its first message
(the copy is done by then); the scheduler's hold timeout releases holds nobody
claims, e.g. when the router died. Holds always end on the engine thread.

Across hosts the export cannot be opened: the decode logs it once and
computes the prompt itself (slower, never wrong).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch

from tandem.engine.connector.base import KVCacheLayout
from tandem.engine.connector.pull import PullConnector, PullMeta
from tandem.engine.connector.shared_cache import ExportedKVCache, KVExport, OpenedKVCache, open_export
from tandem.engine.tensor_parallel import shard_size
from tandem.kernels.kv_cache_dtype import movable

log = logging.getLogger(__name__)

HANDLE_KEY = "direct"  # the handle's key in Request.kv_transfer_params
SOURCE_IDLE_S = 120.0  # a prefill's mapped cache unused this long is unmapped
# Under tensor parallelism (either side) blocks are assembled whole, every
# layer and head: this many at a time bounds the temporary.
WHOLE_BLOCKS_PER_COPY = 64


@dataclass(frozen=True)
class DirectHandle:
    """A prompt's blocks in a prefill engine's shared cache."""

    export: KVExport  # the cache of the prefill's rank 0 (its only one without tensor parallelism)
    model: str  # the producer's block-hash salt (model id, dtype): another model's KV never loads
    block_ids: list[int]  # the prompt's full blocks, in order
    generations: list[int]  # generations[i] of block_ids[i] when the prefill finished
    # Under tensor parallelism the caches of ranks 1.., in order: rank r holds
    # KV heads [r*h, (r+1)*h) of every block (h: export.shape[4]), at the same
    # block ids; rank 0's generations stand for them all.
    rank_exports: tuple[KVExport, ...] = ()

    @property
    def exports(self) -> tuple[KVExport, ...]:
        return (self.export, *self.rank_exports)

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The cache's shape with every rank's KV heads."""
        shape = list(self.export.shape)
        shape[4] *= len(self.exports)
        return tuple(shape)


class DirectConnector(PullConnector):
    handle_key = HANDLE_KEY

    def __init__(self, role: str, layout: KVCacheLayout) -> None:
        super().__init__(role, layout)
        # export name -> every rank's mapping (None: unreachable)
        self._opened: dict[str, Optional[list[OpenedKVCache]]] = {}
        self._last_used: dict[str, float] = {}
        self._shared: Optional[ExportedKVCache] = None  # a producer's cache
        self._rank_exports: tuple[KVExport, ...] = ()  # a producer's other ranks' caches

    # ---- producer: the shared cache, handles and generations -------------
    def allocate_kv_cache(self) -> Optional[torch.Tensor]:
        if not self.produces:
            return None
        layout = self.layout
        # The layout counts every KV head; under tensor parallelism this rank holds its share.
        shape = list(layout.shape)
        shape[4] = shard_size(shape[4], "KV heads")
        self._shared = ExportedKVCache(tuple(shape), layout.dtype, layout.device)
        return self._shared.tensor

    @property
    def export(self) -> KVExport:
        return self._shared.export

    def set_rank_exports(self, exports: list[KVExport]) -> None:
        """Under tensor parallelism: every rank's cache, this one's first."""
        self._rank_exports = tuple(exports[1:])

    def _handle(self, block_ids: list[int]) -> DirectHandle:
        gens = self._shared.generations
        return DirectHandle(self._shared.export, self.layout.model_key, block_ids, [int(gens[i]) for i in block_ids],
                            self._rank_exports)

    def _bump_generations(self, block_ids: np.ndarray) -> None:
        self._shared.generations[block_ids] += 1

    # ---- consumer: copies -----------------------------------------------
    def _reachable(self, handle: DirectHandle) -> Optional[list[OpenedKVCache]]:
        name = handle.export.generations_shm
        self._last_used[name] = time.monotonic()
        if name not in self._opened:
            try:
                self.layout.check_peer(handle.model, handle.whole_shape, handle.export.dtype)
                self._opened[name] = [open_export(e) for e in handle.exports]
            except Exception as exc:
                log.warning("cannot read the prefill's KV cache %s directly, computing prompts "
                            "from it here: %s", name, exc)
                self._opened[name] = None
        return self._opened[name]

    def _close_idle_sources(self) -> None:
        # A prefill that restarted exports a new cache under a new name; the old
        # mapping would keep the dead process's memory (GPU memory, with CUDA
        # IPC) allocated for as long as this engine lives.
        now = time.monotonic()
        for name in [n for n, t in self._last_used.items() if now - t > SOURCE_IDLE_S]:
            self._opened.pop(name, None)
            self._last_used.pop(name, None)

    def build_meta(self, plan, requests: Mapping) -> PullMeta:
        self._close_idle_sources()
        return super().build_meta(plan, requests)

    def start_load(self, meta: PullMeta) -> set[str]:
        if not meta.loads:
            return set()
        started = time.monotonic()
        view = self.cache_view
        device = view.device
        for load in meta.loads:
            ranks = load.source  # the prefill's caches, rank 0 first
            if len(ranks) == 1 and not view.splits_heads:
                self._copy_per_layer(ranks[0].tensor, load.src, load.dst)
                continue
            dst = torch.tensor(load.dst, device=device)
            for first in range(0, len(load.src), WHOLE_BLOCKS_PER_COPY):
                src_ids = load.src[first:first + WHOLE_BLOCKS_PER_COPY]
                # Each prefill rank's heads of these blocks, side by side: whole blocks.
                parts = [r.tensor[:, :, torch.tensor(src_ids, device=r.tensor.device)].to(device) for r in ranks]
                view.write_blocks(dst[first:first + len(src_ids)], torch.cat(parts, dim=4))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the copies are done before the check
        failed: set[str] = set()
        for load in meta.loads:
            gens = load.source[0].generations
            if [int(gens[i]) for i in load.src] != load.expected:
                log.warning("KV blocks of %s were released by the prefill before the copy: recomputing",
                            load.request_id)
                self.stats.load_failures += 1
                failed.add(load.request_id)
                continue
            self.stats.load_blocks += len(load.src)
            self.stats.load_bytes += len(load.src) * self.layout.block_bytes
        self.stats.load_seconds += time.monotonic() - started
        return failed

    def _copy_per_layer(self, src_cache: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
        """One process on each side: straight into this cache, a layer at a
        time (a temporary of one layer's blocks only)."""
        dst_cache, src_cache = movable(self.kv_cache), movable(src_cache)  # FP8: as bytes
        src = torch.tensor(src_ids, device=src_cache.device)
        dst = torch.tensor(dst_ids, device=dst_cache.device)
        for layer in range(dst_cache.shape[0]):
            dst_cache[layer][:, dst] = src_cache[layer][:, src].to(dst_cache.device)

    def close(self) -> None:
        self._opened.clear()
        self._last_used.clear()
        if self._shared is not None:
            self._shared.close()
