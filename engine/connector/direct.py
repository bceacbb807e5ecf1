"""Direct KV transfer between a prefill and a decode process on one host.

The prefill engine's cache is shared memory (shared_cache.py). When a
prompt finishes there, the connector keeps a reference on its full blocks
("holds" them) and describes them in a DirectHandle: the cache's export,
the block ids and their generation counters. The router passes the handle
to the decode engine, whose connector copies those blocks from the mapped
cache into blocks of its own inside the step that admits the request (one
device-to-device copy per layer on a GPU), then checks the generations: a
block the prefill handed out again meanwhile fails the check and the
request computes that part itself.

The router releases a hold once the decode has streamed its first message
(the copy is done by then); `hold_timeout_s` releases holds nobody claims,
e.g. when the router died. Holds always end on the engine thread.

Across hosts the export cannot be opened: the decode logs it once and
computes the prompt itself (slower, never wrong).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.engine.connector.base import BlockTransfer, ConnectorMeta, ConnectorStats, KVConnector
from tandem.engine.connector.shared_cache import KVExport, OpenedKVCache, dtype_name, open_export
from tandem.engine.request import RequestStatus

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


@dataclass
class _Hold:
    blocks: list  # KVCacheBlock
    deadline: float


@dataclass
class _Copy:
    source: OpenedKVCache  # held here, so unmapping an idle source never breaks a planned copy
    src: list[int]
    dst: list[int]
    expected: list[int] = field(default_factory=list)


class DirectConnector(KVConnector):
    def __init__(self, config, kv, runner, hold_timeout_s: float = 30.0) -> None:
        self.role = config.kv_role
        self.kv = kv
        self.runner = runner
        self.block_size = kv.block_size
        self.hold_timeout_s = hold_timeout_s
        self.stats = ConnectorStats()
        self._holds: OrderedDict[str, _Hold] = OrderedDict()  # oldest first
        self._opened: dict[str, Optional[OpenedKVCache]] = {}  # export name -> mapping (None: unreachable)
        self._last_used: dict[str, float] = {}
        self._pending: dict[str, _Copy] = {}  # admitted, not yet planned
        self._planned: dict[str, _Copy] = {}  # in this step's meta
        if self.produces:
            if runner.shared_kv is None:
                raise ValueError("the direct connector's producer needs the runner's shared KV cache")
            self.export = runner.shared_kv.export
            kv.pool.generations = runner.shared_kv.generations

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    # ---- producer: holds ------------------------------------------------
    def request_finished(self, request) -> None:
        rid = request.request_id
        self._pending.pop(rid, None)
        self._planned.pop(rid, None)
        # Only a prompt that finished normally is handed on (not a preemption or an abort).
        if not self.produces or request.status not in (RequestStatus.FINISHED_STOPPED,
                                                       RequestStatus.FINISHED_LENGTH):
            return
        n = request.num_prompt_tokens // self.block_size
        blocks = self.kv.req_to_blocks.get(rid, [])[:n]
        if not blocks:
            return
        self.release(rid)  # a retried request id: its older hold goes first
        self.kv.pool.touch(blocks)
        self._holds[rid] = _Hold(blocks, time.monotonic() + self.hold_timeout_s)
        ids = [b.block_id for b in blocks]
        gens = self.kv.pool.generations
        request.kv_transfer_params[HANDLE_KEY] = DirectHandle(
            self.export, self.kv.hash_extra.decode(), ids, [int(gens[i]) for i in ids])

    def release(self, request_id: str) -> bool:
        """The decode copied the blocks (or never will): drop the hold."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self.kv.pool.free(reversed(hold.blocks))
        return True

    def _expire_holds(self) -> None:
        now = time.monotonic()
        while self._holds:
            rid, hold = next(iter(self._holds.items()))
            if hold.deadline > now:
                return
            log.warning("KV blocks of %s held %.0f s without a release: freed", rid, self.hold_timeout_s)
            self.release(rid)

    # ---- consumer: copies -----------------------------------------------
    def prefetch(self, request) -> None:
        self._expire_holds()  # also runs here: an idle engine steps only when requests arrive

    def _source(self, handle: DirectHandle) -> Optional[OpenedKVCache]:
        name = handle.export.generations_shm
        self._last_used[name] = time.monotonic()
        if name not in self._opened:
            try:
                self._check_layout(handle)
                self._opened[name] = open_export(handle.export)
            except Exception as exc:
                log.warning("cannot read the prefill's KV cache %s directly, computing prompts "
                            "from it here: %s", name, exc)
                self._opened[name] = None
        return self._opened[name]

    def _check_layout(self, handle: DirectHandle) -> None:
        own = self.runner.kv_cache
        if handle.model != self.kv.hash_extra.decode():
            raise ValueError(f"KV of another model or dtype ({handle.model!r})")
        theirs = handle.export.shape
        if theirs[:2] + theirs[3:] != tuple(own.shape[:2] + own.shape[3:]) or \
                handle.export.dtype != dtype_name(own.dtype):
            raise ValueError(f"cache layout {theirs} {handle.export.dtype} does not match this engine's "
                             f"{tuple(own.shape)} {own.dtype}")

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens: int) -> int:
        handle: Optional[DirectHandle] = request.kv_transfer_params.get(HANDLE_KEY)
        if handle is None or not self.consumes:
            return 0
        if self._source(handle) is None:
            if not request.kv_transfer_params.get("direct_failed"):
                request.kv_transfer_params["direct_failed"] = True
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
        self._pending[request.request_id] = _Copy(
            self._source(handle), handle.block_ids[first:last], list(block_ids[first:last]),
            handle.generations[first:last])

    def _close_idle_sources(self) -> None:
        # A prefill that restarted exports a new cache under a new name; the old
        # mapping would keep the dead process's memory (GPU memory, with CUDA
        # IPC) allocated for as long as this engine lives.
        now = time.monotonic()
        for name in [n for n, t in self._last_used.items() if now - t > SOURCE_IDLE_S]:
            self._opened.pop(name, None)
            self._last_used.pop(name, None)

    def build_meta(self, plan) -> ConnectorMeta:
        self._expire_holds()
        self._close_idle_sources()
        meta = ConnectorMeta()
        for s in plan.scheduled:
            rid = s.request.request_id
            copy = self._pending.pop(rid, None)
            if copy is not None:
                self._planned[rid] = copy
                meta.loads.append(BlockTransfer(rid, copy.dst, []))
        return meta

    def start_load(self, meta: ConnectorMeta, kv_caches: list[torch.Tensor]) -> set[str]:
        if not meta.loads:
            return set()
        started = time.monotonic()
        copies = [(t.request_id, self._planned.pop(t.request_id)) for t in meta.loads]
        dst_cache = self.runner.kv_cache
        for _, c in copies:
            src_cache = c.source.tensor
            src = torch.tensor(c.src, device=src_cache.device)
            dst = torch.tensor(c.dst, device=dst_cache.device)
            for layer in range(dst_cache.shape[0]):  # per layer: a temporary of one layer's blocks only
                dst_cache[layer][:, dst] = src_cache[layer][:, src].to(dst_cache.device)
        if dst_cache.device.type == "cuda":
            torch.cuda.current_stream(dst_cache.device).synchronize()  # the copies are done before the check
        failed: set[str] = set()
        for rid, c in copies:
            gens = c.source.generations
            if [int(gens[i]) for i in c.src] != c.expected:
                log.warning("KV blocks of %s were reused by the prefill before the copy: recomputing", rid)
                self.stats.load_failures += 1
                failed.add(rid)
                continue
            self.stats.load_blocks += len(c.src)
            self.stats.load_bytes += len(c.src) * self.runner.block_bytes
        self.stats.load_seconds += time.monotonic() - started
        return failed

    # ---- nothing to save: the prefill's cache is the transfer buffer ----
    def save_layer(self, layer: int, kv_caches: list[torch.Tensor], meta: ConnectorMeta) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def close(self) -> None:
        for rid in list(self._holds):
            self.release(rid)
        self._opened.clear()
        self._last_used.clear()
        if self.runner.shared_kv is not None:
            self.runner.shared_kv.close()
