"""The store connector's plan: what one step loads and saves (StoreMeta, the
ConnectorMeta it hands its worker side), and what a background fetch found
(Prefetched). Plain data; engine/connector/kvstore.py fills and reads it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.engine.connector.base import ConnectorMeta, SlotLease
from tandem.engine.connector.staging import StagingArena


@dataclass
class Prefetched:
    """What a background fetch found for one request: the leading run of its
    blocks the store held, from block index `first_block` on, in arena slots
    from `slot` on, or in the store's own slots pinned by `lease`. `failure`
    names the step that failed (lookup or load), if one did; it is counted
    once, on the engine thread, when the scheduler reads the result. Its
    slots go back with release()."""

    first_block: int
    arena: Optional[StagingArena] = None
    slot: int = 0
    lease: Optional[SlotLease] = None
    hashes: list[bytes] = field(default_factory=list)
    seconds: float = 0.0
    failure: Optional[str] = None
    counted: bool = False
    _released: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def release(self) -> None:
        if self._released or not self.hashes:
            return
        self._released = True
        if self.lease is not None:
            self.lease.release()
        elif self.arena is not None:
            self.arena.free(self.slot, len(self.hashes))


@dataclass
class StoreLoad:
    """Blocks to copy into this engine's cache: from `prefetched` (its blocks
    from `offset` on) or, when None, fetched from the store inside the step."""

    request_id: str
    block_ids: list[int]  # where they go in this engine's cache
    block_hashes: list[bytes]
    prefetched: Optional[Prefetched] = None
    offset: int = 0


@dataclass
class StoreSave:
    """Prompt blocks that are full after this step: stage every layer, then put them."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class StoreMeta(ConnectorMeta):
    loads: list[StoreLoad] = field(default_factory=list)
    saves: list[StoreSave] = field(default_factory=list)
    # Set by save_layer: the slots this step's saves are staged in (-1: none), and their blocks.
    save_slot: int = -1
    num_save_blocks: int = 0
    save_block_ids: Optional[torch.Tensor] = None
    # The saves' layers gathered first, [n, layers, 2, block_size, kv_heads, head_dim],
    # on the cache's device, then one copy per block: into a pinned arena (CUDA), or
    # into the store's own slots (lent_saves).
    save_on_device: Optional[torch.Tensor] = None
    lent_saves: bool = False  # the saves go into slots the store lends, not the arena
    # ... reserved at layer 0, piece by piece: futures of SlotLeases, used at the last layer.
    lent_reservations: list = field(default_factory=list)
    stage_seconds: float = 0.0  # the engine thread's time in save_layer this step
