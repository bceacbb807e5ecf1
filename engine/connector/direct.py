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

log = logging.getLogger(__name__)

HANDLE_KEY = "direct"  # the handle's key in Request.kv_transfer_params
SOURCE_IDLE_S = 120.0  # a prefill's mapped cache unused this long is unmapped


@dataclass(frozen=True)
class DirectHandle:
    """A prompt's blocks in a prefill engine's shared cache."""

    export: KVExport
    model: str  # the producer's block-hash salt (model id, dtype): another model's KV never loads
    block_ids: list[int]  # the prompt's full blocks, in order
    generations: list[int]  # generations[i] of block_ids[i] when the prefill finished


class DirectConnector(PullConnector):
    handle_key = HANDLE_KEY

    def __init__(self, role: str, layout: KVCacheLayout) -> None:
        super().__init__(role, layout)
        self._opened: dict[str, Optional[OpenedKVCache]] = {}  # export name -> mapping (None: unreachable)
        self._last_used: dict[str, float] = {}
        self._shared: Optional[ExportedKVCache] = None  # a producer's cache

    # ---- producer: the shared cache, handles and generations -------------
    def allocate_kv_cache(self) -> Optional[torch.Tensor]:
        if not self.produces:
            return None
        layout = self.layout
        self._shared = ExportedKVCache(layout.shape, layout.dtype, layout.device)
        return self._shared.tensor

    def _handle(self, block_ids: list[int]) -> DirectHandle:
        gens = self._shared.generations
        return DirectHandle(self._shared.export, self.layout.model_key, block_ids, [int(gens[i]) for i in block_ids])

    def _bump_generations(self, block_ids: np.ndarray) -> None:
        self._shared.generations[block_ids] += 1

    # ---- consumer: copies -----------------------------------------------
    def _reachable(self, handle: DirectHandle) -> Optional[OpenedKVCache]:
        name = handle.export.generations_shm
        self._last_used[name] = time.monotonic()
        if name not in self._opened:
            try:
                self.layout.check_peer(handle.model, handle.export.shape, handle.export.dtype)
                self._opened[name] = open_export(handle.export)
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
        dst_cache = self.kv_cache
        for load in meta.loads:
            src_cache = load.source.tensor
            src = torch.tensor(load.src, device=src_cache.device)
            dst = torch.tensor(load.dst, device=dst_cache.device)
            for layer in range(dst_cache.shape[0]):  # per layer: a temporary of one layer's blocks only
                dst_cache[layer][:, dst] = src_cache[layer][:, src].to(dst_cache.device)
        if dst_cache.device.type == "cuda":
            torch.cuda.current_stream(dst_cache.device).synchronize()  # the copies are done before the check
        failed: set[str] = set()
        for load in meta.loads:
            gens = load.source.generations
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

    def close(self) -> None:
        self._opened.clear()
        self._last_used.clear()
        if self._shared is not None:
            self._shared.close()
