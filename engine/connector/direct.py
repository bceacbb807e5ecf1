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
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np
import torch

from tandem.engine.connector.base import ConnectorMeta, KVCacheLayout, KVConnector
from tandem.engine.connector.shared_cache import ExportedKVCache, KVExport, OpenedKVCache, open_export
from tandem.engine.request import RequestStatus

log = logging.getLogger(__name__)

HANDLE_KEY = "direct"  # the handle's key in Request.kv_transfer_params
UNREACHABLE_KEY = "direct_unreachable"  # set there once a handle could not be opened (counted once)
SOURCE_IDLE_S = 120.0  # a prefill's mapped cache unused this long is unmapped


@dataclass(frozen=True)
class DirectHandle:
    """A prompt's blocks in a prefill engine's shared cache."""

    export: KVExport
    model: str  # the producer's block-hash salt (model id, dtype): another model's KV never loads
    block_ids: list[int]  # the prompt's full blocks, in order
    generations: list[int]  # generations[i] of block_ids[i] when the prefill finished


@dataclass
class DirectLoad:
    """Copy blocks `src` of a prefill's mapped cache into this engine's blocks `dst`."""

    request_id: str
    source: OpenedKVCache  # held here, so unmapping an idle source never breaks a planned copy
    src: list[int]
    dst: list[int]
    expected: list[int] = field(default_factory=list)  # the generations of `src` in the handle


@dataclass
class DirectMeta(ConnectorMeta):
    loads: list[DirectLoad] = field(default_factory=list)


class DirectConnector(KVConnector):
    def __init__(self, role: str, layout: KVCacheLayout) -> None:
        super().__init__(role, layout)
        self.block_size = layout.block_size
        self._opened: dict[str, Optional[OpenedKVCache]] = {}  # export name -> mapping (None: unreachable)
        self._last_used: dict[str, float] = {}
        self._admitted: list[DirectLoad] = []  # loads of the schedule() under way
        self._shared: Optional[ExportedKVCache] = None  # a producer's cache
        self._holds_per_block: Optional[np.ndarray] = None

    # ---- producer: the shared cache, handles and generations -------------
    def allocate_kv_cache(self) -> Optional[torch.Tensor]:
        if not self.produces:
            return None
        layout = self.layout
        self._shared = ExportedKVCache(layout.shape, layout.dtype, layout.device)
        self._holds_per_block = np.zeros(layout.num_blocks, dtype=np.int64)
        return self._shared.tensor

    def request_finished(self, request, block_ids: list[int]) -> tuple[int, dict]:
        # Only a prompt that finished normally is handed on (not an abort or an error).
        if not self.produces or request.status not in (RequestStatus.FINISHED_STOPPED,
                                                       RequestStatus.FINISHED_LENGTH):
            return 0, {}
        ids = list(block_ids[: request.num_prompt_tokens // self.block_size])
        if not ids:
            return 0, {}
        self._holds_per_block[ids] += 1
        gens = self._shared.generations
        handle = DirectHandle(self._shared.export, self.layout.model_key, ids, [int(gens[i]) for i in ids])
        return len(ids), {HANDLE_KEY: handle}

    def hold_released(self, request_id: str, params: dict) -> None:
        handle: Optional[DirectHandle] = params.get(HANDLE_KEY)
        if handle is None:
            return
        ids = np.asarray(handle.block_ids, dtype=np.int64)
        self._holds_per_block[ids] -= 1
        # No hold is left on these: the pool may hand them out now, and a copy
        # still to come must see that.
        free = ids[self._holds_per_block[ids] == 0]
        self._shared.generations[free] += 1

    # ---- consumer: copies -----------------------------------------------
    def _source(self, handle: DirectHandle) -> Optional[OpenedKVCache]:
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

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens: int) -> int:
        handle: Optional[DirectHandle] = request.kv_transfer_params.get(HANDLE_KEY)
        if handle is None or not self.consumes:
            return 0
        if self._source(handle) is None:
            if not request.kv_transfer_params.get(UNREACHABLE_KEY):
                request.kv_transfer_params[UNREACHABLE_KEY] = True
                self.stats.load_failures += 1
            return 0
        last = min(len(handle.block_ids), (request.num_tokens - 1) // self.block_size)
        first = num_local_hit_tokens // self.block_size
        return max(0, last - first) * self.block_size

    def update_state_after_alloc(self, request, block_ids, num_local_hit_tokens, num_external_tokens) -> None:
        if num_external_tokens <= 0:
            return
        handle: DirectHandle = request.kv_transfer_params[HANDLE_KEY]
        first = num_local_hit_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._admitted.append(DirectLoad(
            request.request_id, self._source(handle), handle.block_ids[first:last],
            list(block_ids[first:last]), handle.generations[first:last]))

    def _close_idle_sources(self) -> None:
        # A prefill that restarted exports a new cache under a new name; the old
        # mapping would keep the dead process's memory (GPU memory, with CUDA
        # IPC) allocated for as long as this engine lives.
        now = time.monotonic()
        for name in [n for n, t in self._last_used.items() if now - t > SOURCE_IDLE_S]:
            self._opened.pop(name, None)
            self._last_used.pop(name, None)

    def build_meta(self, plan, requests: Mapping) -> DirectMeta:
        self._close_idle_sources()
        meta = DirectMeta(loads=self._admitted)
        self._admitted = []
        return meta

    def start_load(self, meta: DirectMeta) -> set[str]:
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
