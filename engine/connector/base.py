"""The KV connector: the seam between an engine and KV that lives elsewhere.

A connector gets narrow dependencies: its role, the KV cache's layout
(KVCacheLayout) and, for a store, a KVStore the service injects. It never
sees the block pool, the runner or the scheduler. Everything the engine calls
is on the KVConnector ABC below; the scheduler side decides (on the engine
thread), the worker side moves bytes, and the step's ConnectorMeta (built by
build_meta) is the only channel between them: it carries the whole worker
job, so the worker side reads no private state of the scheduler side.

Scheduler side:
  prefetch(request, num_local_hit_tokens) -> start fetching in the background;
  is_ready(request) -> False while that fetch runs (the request waits);
  get_num_new_matched_tokens(request, num_local_hit_tokens) -> how many more
      prompt tokens, beyond the local prefix-cache hits, the connector can
      supply (whole blocks; at least one token is always left to compute);
  update_state_after_alloc(request, block_ids, num_local_hit_tokens, num_external_tokens)
      -> the request got blocks: remember which to fill;
  build_meta(plan, requests) -> this step's whole worker job;
  request_finished(request, block_ids) -> (hold, params): the request leaves
      for good (finished or aborted, once); the scheduler keeps its first
      `hold` blocks for a consumer until release or timeout, and params go to
      the request's output (e.g. a handle to those blocks);
  hold_released(request_id, params) -> the scheduler let such a hold go.
Worker side:
  allocate_kv_cache() -> the cache tensor, when the connector must own its
      memory (e.g. shared with another process); None: a plain allocation;
  register_kv_cache(kv_cache, view) -> the cache the worker side reads and
      writes, and the view of its whole blocks (every KV head: under tensor
      parallelism the cache holds this rank's heads, the view every rank's);
  start_load(meta) -> request ids whose load failed (they recompute);
  wait_for_layer_load(layer) -> called before layer `layer` reads its cache;
  save_layer(layer, meta) -> called as soon as layer `layer` wrote its K/V;
  wait_for_save() -> the step's saves are far enough along for the step to
      end (staged, for a store: its writes finish in the background).
Prefill engines save; decode engines load; "both" does both.

Invariant the scheduler keeps: when a scheduler-side method is called,
request.block_hashes names every full block of the request's known tokens.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

import torch

from tandem.kernels.kv_cache_dtype import movable

if TYPE_CHECKING:
    from tandem.engine.plan import SchedulerOutput
    from tandem.engine.request import Request


class KVStore(Protocol):
    """What the store connector needs of a KV store: values under string keys,
    moved to and from an arena of bytes the store hands out (open_arena), so a
    store can move them without copying (over a socket, or from another
    process that maps the same memory). The engine defines it; the service
    that runs the engine injects an implementation
    (tandem.services.kvstore.block_client.BlockStoreClient), so the engine
    library never imports a service. Every method but open_arena may raise:
    the connector treats a failure as "the store has nothing" and recomputes."""

    def open_arena(self, nbytes: int) -> memoryview:
        """The arena (at least nbytes, writable): called once, before put and get."""

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def put(self, items: Sequence[tuple[str, int, int]]) -> int:
        """Store each (key, offset, length): the value is arena[offset:offset + length].
        Returns how many were stored."""

    def get(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        """Read each (key, offset, length) into arena[offset:offset + length]; False
        where the store lacks the key or holds a value of another length (that
        slot is then left undefined)."""

    def close(self) -> None: ...


class SlotLease(Protocol):
    """Slots of the store's memory lent for one call's keys (see StoreSlots):
    views[i] is key i's slot (None: not lent). Ends with commit() (a
    reservation: the filled slots become their keys' values, whole) or
    release() (pins let go, uncommitted reservations dropped; never raises)."""

    views: list[Optional[memoryview]]

    @property
    def num_lent(self) -> int: ...

    def commit(self) -> int: ...

    def release(self) -> None: ...


class StoreSlots(Protocol):
    """The store's own memory, lent to an engine on its host, so a block moves
    between the engine's cache and the store with one copy (a DMA on a GPU)
    and no staging arena. A KVStore may offer it: `lent_slots(pin_memory,
    unpin_memory)` returns one (pin_memory page-locks each slab the engine
    maps, for the GPU; observe(phase, seconds) hears how long each took), or the
    store has no such method."""

    def usable(self) -> bool:
        """Whether lending works now (asked of the store now and then; never raises)."""

    def map_all(self, timeout_s: float) -> bool:
        """Map every slab of the store now (before serving), waiting up to
        timeout_s while it still allocates them; True once all are."""

    def set_aside(self, why: str) -> None:
        """Stop using it for a while (e.g. a reserve found no slot to lend)."""

    def reserve(self, keys: Sequence[str], length: int) -> SlotLease: ...

    def pin(self, keys: Sequence[str], length: int) -> SlotLease: ...

    def close(self) -> None: ...


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as handles and block headers name it ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVCacheLayout:
    """The engine's KV cache as a connector needs to know it: one tensor
    [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # Names the blocks' content beside their tokens (model id and dtype): KV of
    # another model or precision never loads.
    model_key: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer: [2, block_size, num_kv_heads, head_dim]."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def check_peer(self, model: str, shape: tuple[int, ...], dtype: str) -> None:
        """Raises ValueError unless another engine's cache (its model key, shape
        and dtype name) holds blocks this one can take: the same model and
        precision, and the same layout but for the number of blocks."""
        if model != self.model_key:
            raise ValueError(f"KV of another model or dtype ({model!r})")
        shape = tuple(shape)
        if shape[:2] + shape[3:] != self.shape[:2] + self.shape[3:] or dtype != self.dtype_name:
            raise ValueError(f"cache layout {shape} {dtype} does not match this engine's "
                             f"{self.shape} {self.dtype}")


class KVCacheView:
    """Whole blocks of an engine's KV cache, every layer and KV head, as a
    connector that copies blocks reads and writes them. This one is the
    cache tensor of an engine in one process; under tensor parallelism each
    rank holds a slice of the KV heads and engine/tp_kv.py's view reaches
    the other ranks' slices, so the blocks a connector moves are the same
    whatever the tensor parallelism."""

    splits_heads = False  # True where other processes hold some of the KV heads

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_cache.dtype

    def layer_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Layer `layer` of these blocks: [2, n, block_size, kv_heads, head_dim]."""
        return self.kv_cache[layer][:, block_ids]

    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write whole blocks, [layers, 2, n, block_size, kv_heads, head_dim], into
        these cache blocks. `blocks` may be reused by the caller once this returns
        (on a GPU: once the current stream has passed this point)."""
        movable(self.kv_cache)[:, :, block_ids] = movable(blocks)  # FP8: as bytes (kv_cache_dtype.py)


@dataclass
class ConnectorMeta:
    """One step's worker job. Each connector subclasses it with its own load
    and save entries; the engine only asks whether there is work, and which
    blocks the saves read."""

    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)

    def saved_block_ids(self) -> list[int]:
        """The cache blocks this step's saves read, in the order save_layer
        reads them (each save entry's block_ids, entry after entry)."""
        return [b for save in self.saves for b in save.block_ids]


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
    write_wait_seconds: float = 0.0  # waiting for blocks a prefill was still writing
    write_wait_timeouts: int = 0  # ... that had not all landed in time
    # Store connector: blocks saved into / loaded from the store's own slots (StoreSlots), no arena.
    save_blocks_lent: int = 0
    load_blocks_lent: int = 0
    # Where a transfer's time goes, by phase (see KV_PHASES): seconds and how
    # many times each phase ran. Connector threads observe them concurrently.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_counts: dict[str, int] = field(default_factory=dict)
    _phase_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def observe(self, phase: str, seconds: float) -> None:
        """One run of `phase` took `seconds` (safe from any thread)."""
        with self._phase_lock:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
            self.phase_counts[phase] = self.phase_counts.get(phase, 0) + 1

    def phases(self) -> tuple[dict[str, float], dict[str, int]]:
        """A consistent copy of (phase_seconds, phase_counts)."""
        with self._phase_lock:
            return dict(self.phase_seconds), dict(self.phase_counts)


# The phases a store connector times (ConnectorStats.observe), in the order a
# block meets them. The engine thread waits in the ones marked so; the others
# run beside it.
KV_PHASES = {
    "save_slot_wait": "prefill, engine thread: a step's saves wait for staging slots earlier puts hold",
    "save_stage": "prefill, engine thread: gathering a step's blocks and queuing their copies to the host",
    "save_copy": "prefill: a piece's copies from the GPU into the staging arena (or the store's lent slots), "
                 "waited for before its put (or commit)",
    "save_put": "prefill: one piece of a step's blocks put into the store (lent slots: committed)",
    "save_reserve": "prefill, lent slots: the store reserving a piece's slots, asked at the step's first layer",
    "save_reserve_wait": "prefill, engine thread, lent slots: the last layer waiting for those reservations",
    "slots_map": "lent slots: mapping one of the store's slabs and page-locking it for the GPU",
    "load_write_wait": "decode: waiting for blocks the prefill was still writing",
    "load_lookup": "decode: asking the store which blocks it holds",
    "load_slot_wait": "decode: a fetch waits for staging slots",
    "load_get": "decode: reading a request's blocks from the store into the staging arena (lent slots: pinning them)",
    "load_fetch": "decode: a whole background fetch, from the request's arrival until its blocks are staged",
    "load_copy_in": "decode, engine thread: staged blocks copied into the KV cache",
}


class KVConnector(ABC):
    def __init__(self, role: str, layout: KVCacheLayout) -> None:
        if role not in ("producer", "consumer", "both"):
            raise ValueError(f"kv_role must be producer, consumer or both, got {role!r}")
        self.role = role
        self.layout = layout
        self.stats = ConnectorStats()
        self.kv_cache: Optional[torch.Tensor] = None  # set by register_kv_cache
        self.cache_view: Optional[KVCacheView] = None  # ditto

    @property
    def produces(self) -> bool:
        """Hands KV on: saves to a store, or holds blocks for a decode to copy."""
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        """Takes KV in from elsewhere instead of computing it."""
        return self.role in ("consumer", "both")

    # ---- scheduler side ------------------------------------------------
    def prefetch(self, request: "Request", num_local_hit_tokens: int) -> None:
        """A request arrived: start fetching what lies outside for it in the
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
    def build_meta(self, plan: "SchedulerOutput", requests: Mapping[str, "Request"]) -> ConnectorMeta:
        """The worker job of this plan; `requests` maps the plan's request ids
        to their requests (read them, keep nothing)."""

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[int, dict]:
        """The request leaves for good; returns (how many of its leading blocks
        the scheduler holds for a consumer, params for its output)."""
        return 0, {}

    def hold_released(self, request_id: str, params: dict) -> None:
        """The scheduler gave back the blocks it held for this request."""

    # ---- worker side ---------------------------------------------------
    def allocate_kv_cache(self) -> Optional[torch.Tensor]:
        """The KV cache tensor (layout.shape, zeroed) when this connector must own
        its memory; None: the runner allocates it."""
        return None

    def register_kv_cache(self, kv_cache: torch.Tensor, view: Optional[KVCacheView] = None) -> None:
        """view: whole blocks of the cache; None: the cache itself (one process)."""
        self.kv_cache = kv_cache
        self.cache_view = view if view is not None else KVCacheView(kv_cache)

    @abstractmethod
    def start_load(self, meta: ConnectorMeta) -> set[str]: ...

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads that finish layer by layer wait here; start_load's are whole."""

    def save_layer(self, layer: int, meta: ConnectorMeta) -> None:
        """Layer `layer` has written this step's K/V (a producer's hook)."""

    def wait_for_save(self) -> None:
        """Every save of this step is done or failed (a producer's hook)."""

    def close(self) -> None:
        pass
