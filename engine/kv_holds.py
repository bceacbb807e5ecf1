"""Blocks a finished request leaves behind for a consumer.

A producer's connector may ask, when a request finishes, that its first
blocks outlive it (the direct transfer: a decode engine copies them from
this engine's shared cache). The scheduler owns those holds: each is one
more reference on its blocks, ended by release() when the consumer has them
or by expire() after timeout_s, always on the engine thread; the connector
hears of each end (hold_released), since from then on the pool may hand the
blocks out again.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request

if TYPE_CHECKING:
    from tandem.engine.block_pool import KVCacheBlock
    from tandem.engine.connector.base import KVConnector

log = logging.getLogger(__name__)


@dataclass
class _Hold:
    blocks: list["KVCacheBlock"]
    deadline: float
    params: dict  # what the connector handed out with them


class KVHolds:
    def __init__(self, kv: KVCacheManager, connector: Optional["KVConnector"], timeout_s: float) -> None:
        self.kv = kv
        self.connector = connector
        self.timeout_s = timeout_s
        self._holds: OrderedDict[str, _Hold] = OrderedDict()  # oldest first

    def hold(self, request: Request, num_blocks: int, params: dict) -> None:
        """Keep the request's first num_blocks blocks past its free()."""
        self.release(request.request_id)  # a retried request id: its older hold goes first
        self._holds[request.request_id] = _Hold(self.kv.hold(request, num_blocks),
                                                 time.monotonic() + self.timeout_s, params)

    def release(self, request_id: str) -> bool:
        """The consumer has the blocks (or never will): give them back. False
        when nothing is held for request_id (released before, or expired)."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self.kv.release(hold.blocks)
        if self.connector is not None:
            self.connector.hold_released(request_id, hold.params)
        return True

    def expire(self) -> None:
        now = time.monotonic()
        while self._holds:
            request_id, hold = next(iter(self._holds.items()))
            if hold.deadline > now:
                return
            log.warning("KV blocks of %s held %.0f s without a release: freed", request_id, self.timeout_s)
            self.release(request_id)

    @property
    def num_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())
