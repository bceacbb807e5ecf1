"""Connectors where a prefill holds a finished prompt's blocks and a decode
pulls them out of the prefill's cache (direct.py: shared memory or CUDA IPC
on one host; nixl.py: NIXL, across hosts). This base keeps what both do the
same way:

- the producer's holds: when a prompt finishes normally, its full blocks are
  held (the scheduler keeps them until release or timeout) and described in a
  handle (the subclass's); each block counts the holds on it, and when the
  last one ends its generation grows by one (the subclass stores the
  counters where readers can see them);
- the consumer's plan: how many prompt tokens a handle supplies (whole
  blocks, one token always left to compute), which blocks to copy into which
  once the scheduler has allocated them, and the step's loads.

A handle names the blocks with their generations at the time the prompt
finished: a reader that finds a generation changed after its copy knows the
block was released (and may have been handed out again) and recomputes.
Subclasses move the bytes (start_load) and say whether a handle's cache can
be reached from here (_reachable); one that cannot is counted once per
request and computed around.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from tandem.engine.connector.base import ConnectorMeta, KVCacheLayout, KVConnector
from tandem.engine.request import RequestStatus


@dataclass
class PullLoad:
    """Copy blocks `src` of a producer's cache into this engine's blocks `dst`;
    `expected` are the generations of `src` in the handle. `source` is what
    the subclass reads from (e.g. the mapped cache, held here so that it stays
    mapped until the copy)."""

    request_id: str
    handle: Any
    src: list[int]
    dst: list[int]
    expected: list[int] = field(default_factory=list)
    source: Any = None


@dataclass
class PullMeta(ConnectorMeta):
    loads: list[PullLoad] = field(default_factory=list)


class PullConnector(KVConnector):
    # The handle's key in Request.kv_transfer_params (and the router's KVHandle).
    handle_key: str = ""

    def __init__(self, role: str, layout: KVCacheLayout) -> None:
        super().__init__(role, layout)
        self.block_size = layout.block_size
        self._holds_per_block = np.zeros(layout.num_blocks, dtype=np.int64)  # producer
        self._admitted: list[PullLoad] = []  # consumer: loads of the schedule() under way

    @property
    def unreachable_key(self) -> str:
        """Set in a request's kv_transfer_params once its handle could not be used (counted once)."""
        return f"{self.handle_key}_unreachable"

    # ---- producer: holds and handles -----------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> tuple[int, dict]:
        # Only a prompt that finished normally is handed on (not an abort or an error).
        if not self.produces or request.status not in (RequestStatus.FINISHED_STOPPED,
                                                       RequestStatus.FINISHED_LENGTH):
            return 0, {}
        ids = list(block_ids[: request.num_prompt_tokens // self.block_size])
        if not ids:
            return 0, {}
        self._holds_per_block[ids] += 1
        return len(ids), {self.handle_key: self._handle(ids)}

    def hold_released(self, request_id: str, params: dict) -> None:
        handle = params.get(self.handle_key)
        if handle is None:
            return
        ids = np.asarray(handle.block_ids, dtype=np.int64)
        self._holds_per_block[ids] -= 1
        # No hold is left on these: the pool may hand them out now, and a copy
        # still to come must see that.
        self._bump_generations(ids[self._holds_per_block[ids] == 0])

    @abstractmethod
    def _handle(self, block_ids: list[int]) -> Any:
        """The handle of these held blocks (their ids and generations, and how to reach them)."""

    @abstractmethod
    def _bump_generations(self, block_ids: np.ndarray) -> None:
        """Grow these blocks' generation counters by one."""

    # ---- consumer: the plan ---------------------------------------------------
    @abstractmethod
    def _reachable(self, handle: Any) -> Any:
        """What to read the handle's blocks from, or None when that cannot be
        done from here (another host, another model's cache)."""

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens: int) -> int:
        handle = request.kv_transfer_params.get(self.handle_key)
        if handle is None or not self.consumes:
            return 0
        if self._reachable(handle) is None:
            if not request.kv_transfer_params.get(self.unreachable_key):
                request.kv_transfer_params[self.unreachable_key] = True
                self.stats.load_failures += 1
            return 0
        last = min(len(handle.block_ids), (request.num_tokens - 1) // self.block_size)
        first = num_local_hit_tokens // self.block_size
        return max(0, last - first) * self.block_size

    def update_state_after_alloc(self, request, block_ids, num_local_hit_tokens, num_external_tokens) -> None:
        if num_external_tokens <= 0:
            return
        handle = request.kv_transfer_params[self.handle_key]
        first = num_local_hit_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._admitted.append(PullLoad(request.request_id, handle, handle.block_ids[first:last],
                                       list(block_ids[first:last]), handle.generations[first:last],
                                       source=self._reachable(handle)))

    def build_meta(self, plan, requests: Mapping) -> PullMeta:
        meta = PullMeta(loads=self._admitted)
        self._admitted = []
        return meta
