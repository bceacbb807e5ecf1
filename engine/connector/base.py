"""The KV connector: the seam between an engine and KV that lives elsewhere.

Scheduler side (decides, on the engine thread):
  prefetch(request) -> start fetching the request's stored blocks in the
      background, so the step that admits it does not wait on the store;
  is_ready(request) -> False while that fetch runs (the request waits);
  get_num_new_matched_tokens(request, num_local_hit_tokens) -> how many more
      prompt tokens, beyond the local prefix-cache hits, the store can supply
      (whole blocks; at least one token is always left to compute);
  update_state_after_alloc(request, block_ids, num_local_hit_tokens, num_external_tokens)
      -> remember which fresh blocks to fill;
  build_meta(plan) -> what the worker must load and save this step;
  request_finished(request) -> forget per-request state.
Worker side (moves bytes):
  start_load(meta, kv_caches) -> request ids whose load failed (they recompute);
  wait_for_layer_load(layer);
  save_layer(layer, kv_caches, meta) -> called as soon as a layer wrote its K/V;
  wait_for_save() -> every save of this step is stored (or failed and counted).
Prefill engines save; decode engines load; "both" does both.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.scheduler import SchedulerOutput


class KVStore(Protocol):
    """What the store connector needs of a KV store: bytes under string keys.
    The engine defines it; the service that runs the engine injects an
    implementation (tandem.services.kvstore.client.KVStoreClient), so the
    engine library never imports a service. Every method may raise: the
    connector treats a failure as "the store has nothing" and recomputes."""

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]: ...

    def put(self, items: Sequence[tuple[str, bytes]]) -> int: ...

    def close(self) -> None: ...


@dataclass
class BlockTransfer:
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class ConnectorMeta:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class ConnectorStats:
    save_bytes: int = 0
    save_blocks: int = 0
    save_seconds: float = 0.0
    load_bytes: int = 0
    load_blocks: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0  # requests that fell back to recompute
    save_failures: int = 0
    lookup_failures: int = 0  # store lookups that failed: the prefix is computed locally


class KVConnector(ABC):
    stats: ConnectorStats
    role: str = "both"  # "producer" (prefill), "consumer" (decode) or "both"

    @property
    def produces(self) -> bool:
        """Hands KV on: saves to a store, or holds blocks for a decode to copy."""
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        """Takes KV in from elsewhere instead of computing it."""
        return self.role in ("consumer", "both")

    # scheduler side
    def prefetch(self, request: "Request") -> None:
        """A request arrived: start fetching what the store holds for it in the
        background (optional; the default fetches at load time, inside the step)."""

    def is_ready(self, request: "Request") -> bool:
        """False while the request's prefetch is running: the scheduler then
        leaves it waiting, and the batch keeps stepping without it."""
        return True

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_local_hit_tokens: int) -> int: ...

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_meta(self, plan: "SchedulerOutput") -> ConnectorMeta: ...

    def request_finished(self, request: "Request") -> None:
        pass

    # worker side
    @abstractmethod
    def start_load(self, meta: ConnectorMeta, kv_caches: list[torch.Tensor]) -> set[str]: ...

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    @abstractmethod
    def save_layer(self, layer: int, kv_caches: list[torch.Tensor], meta: ConnectorMeta) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def close(self) -> None:
        pass
