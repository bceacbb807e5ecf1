"""The store connector: KV blocks in a KVStore, which the engine role injects
(its client of tandem's KV store service).

One value per block, holding every layer, under the block's chained hash
(hex), so a block saved by any prefill instance is a prefix-cache hit for
every decode (and prefill) instance. A value is stored whole or not at all,
so a block is present exactly when its key is, and a reader never sees half
of one.

Blocks pass through a StagingArena in the store's arena: a step's saves are
written into their slots layer by layer as the model runs (after_layer) and
put once the last layer is in; a load is read into slots on a background
thread (prefetch) or inside the step, then copied into the cache in one go.

On the store's host the store may lend its own memory instead (StoreSlots,
--kv-store-slots): a step's saves are gathered on the cache's device, then
each block is copied into a slot the store reserved and committed; a load
pins the values' slots and copies them into the cache from there. On a GPU
that is one DMA per block each way, with no host copy at all.

A step does not wait for its puts: the prefill answers once its blocks are
staged, and says in its output (kv_transfer_params[WRITE_KEY]) which blocks
it is still writing. The decode's fetch waits until the store has those
(WRITE_WAIT_S at most, and not at all once the store cannot be asked), then
looks the prompt up; a write that never lands costs a recompute, and a value
is visible only once whole, so a block is never read half-written.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, Optional, Sequence

import torch

from tandem.engine.connector.base import KVCacheLayout, KVConnector, KVStore, StoreSlots
from tandem.engine.connector.serialization import HEADER_BYTES, BlockFormatError, block_header, check_block_header
from tandem.engine.connector.staging import StagingArena, pin_host_memory, unpin_host_memory
from tandem.engine.connector.store_plan import Prefetched, StoreLoad, StoreMeta, StoreSave

log = logging.getLogger(__name__)

# The staging arena: at most this many blocks, in the bytes the engine gives
# it (--kv-staging-gib; a prefill step of 8192 tokens saves 512 blocks of 16,
# Llama-3-8B's are 2 MiB).
STAGING_SLOTS = 4096
STAGING_BYTES = 1 << 30
# How long a step's saves wait for slots that earlier saves still use.
SAVE_SLOT_WAIT_S = 5.0
# How long a background fetch waits for slots (other fetches' and the saves'
# come back as their requests are admitted and their puts land); the request
# waits outside the batch meanwhile, and computes its blocks after that.
PREFETCH_SLOT_WAIT_S = 2.0
# Fetches at once. Each mostly waits (for its prefill's writes to land, then
# on the store), so a few more than the cores a load needs: with two, requests
# arriving together queued behind one another's write waits.
PREFETCH_THREADS = 8
# Puts of a step's saves: pieces of this many blocks (64 MiB of Llama-3-8B), this many at once.
PUT_CHUNK_BLOCKS = 32
SAVE_THREADS = 4
# The key, in a prefill's kv_transfer_params and a decode's, of the blocks the
# prefill was still writing when it answered: (first block index, count).
WRITE_KEY = "kv_store_write"
# How long a decode's fetch waits for those writes to land before it looks up
# what is there (a 2k-token Llama-3-8B prompt, 272 MiB, takes 30-300 ms to write).
WRITE_WAIT_S = 2.0
WRITE_POLL_S = (0.001, 0.008)  # first and longest pause between lookups while waiting
# --kv-store-slots: when to use the store's own slots (auto: for a GPU cache, where they save two host copies).
SLOTS_POLICIES = ("auto", "on", "off")
# At start, how long an engine waits for a store that is still allocating its memory
# (--preallocate) to map all of it; 48 GiB took about 20 s on the H200 host.
SLOTS_MAP_TIMEOUT_S = 120.0


def block_key(block_hash: bytes) -> str:
    return block_hash.hex()


def _release_after(copied: "torch.cuda.Event", prefetched: Prefetched) -> None:
    copied.synchronize()  # waits without the GIL
    prefetched.release()


class _StepSave:
    """A step's saves while their pieces are being put (counted under the stats lock)."""

    __slots__ = ("staged_at", "pieces")

    def __init__(self, staged_at: float, pieces: int) -> None:
        self.staged_at, self.pieces = staged_at, pieces


class _BlockBudget:
    """Blocks in flight to the store's slots: a step's gathered saves hold
    device memory until their copies are done, so they are bounded as the
    arena bounds its own."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._lock = threading.Condition()

    def acquire(self, n: int, wait_s: float) -> bool:
        if n > self.capacity:
            return False
        with self._lock:
            if not self._lock.wait_for(lambda: self.used + n <= self.capacity, timeout=wait_s):
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n
            self._lock.notify_all()


def _pin_for_cuda(view: memoryview) -> bool:
    return pin_host_memory(view) == 0


class KVStoreConnector(KVConnector):
    def __init__(self, role: str, layout: KVCacheLayout, store: KVStore, staging_bytes: int = STAGING_BYTES,
                 slots_policy: str = "auto") -> None:
        super().__init__(role, layout)
        if slots_policy not in SLOTS_POLICIES:
            raise ValueError(f"slots_policy must be one of {SLOTS_POLICIES}, got {slots_policy!r}")
        self.client = store
        self.block_size = layout.block_size
        slot = StagingArena.slot_size(layout)
        num_slots = max(1, min(STAGING_SLOTS, staging_bytes // slot))
        self.arena = StagingArena(store.open_arena(num_slots * slot), layout)
        self.slots_policy = slots_policy
        self.slots: Optional[StoreSlots] = None  # the store's own slots, once the cache is known (register_kv_cache)
        self._lent_budget = _BlockBudget(num_slots)
        self._value_bytes = HEADER_BYTES + layout.block_bytes
        self._header = torch.frombuffer(bytearray(block_header(layout.dtype, self.arena.block_shape)),
                                        dtype=torch.uint8)
        # Background fetches (decode and prefill alike): request id -> future of Prefetched.
        self._loader = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix="kv-prefetch")
        self._prefetches: dict[str, Future] = {}
        # Loads of requests admitted by the schedule() under way: build_meta moves them into the meta.
        self._admitted: list[StoreLoad] = []
        # A step's saves go out in pieces of PUT_CHUNK_BLOCKS, several at once:
        # the store copies each on a connection (and a core) of its own, and
        # each piece's slots come back as soon as it is stored.
        self._saver = ThreadPoolExecutor(max_workers=SAVE_THREADS, thread_name_prefix="kv-save")
        # Reservations of the store's own slots, asked at a step's first layer and
        # answered while the others run (commits wait on the saver threads).
        self._reserver = ThreadPoolExecutor(max_workers=SAVE_THREADS, thread_name_prefix="kv-reserve")
        self._unfinished_lent: Optional[tuple[list[Future], int]] = None  # (reservations, blocks) of this step
        self._saves: list[Future] = []  # puts still running
        self._stats_lock = threading.Lock()  # the saver and loader threads count into self.stats
        # Prompt blocks each unfinished request had staged for the store: [first, last).
        self._written: dict[str, tuple[int, int]] = {}
        self._copy_stream: Optional[torch.cuda.Stream] = None  # CUDA: the saves' copies to the host
        self._load_stream: Optional[torch.cuda.Stream] = None  # CUDA: the loads' copies to the device
        # CUDA: gives loads' staging slots back once their copies into the cache are done.
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-release")

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
            landing = self._landing(request, first, last)
            self._prefetches[request.request_id] = self._loader.submit(
                self._fetch, first, list(request.block_hashes[first:last]), landing, time.monotonic())

    @staticmethod
    def _landing(request, first: int, last: int) -> list[bytes]:
        """Hashes of this request's blocks in [first, last) whose write its
        prefill had not seen finish when it answered."""
        write = request.kv_transfer_params.get(WRITE_KEY)
        if not write:
            return []
        start, count = write
        lo, hi = max(first, start), min(last, start + count)
        return list(request.block_hashes[lo:hi]) if hi > lo else []

    def is_ready(self, request) -> bool:
        fut = self._prefetches.get(request.request_id)
        return fut is None or fut.done()

    def _num_leading_present(self, candidates: list[bytes]) -> int:
        """How many of `candidates`, from the first on, the store holds (raises
        when the store cannot be asked)."""
        started = time.monotonic()
        present = self.client.exists([block_key(h) for h in candidates])
        self.stats.observe("load_lookup", time.monotonic() - started)
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def _fetch(self, first: int, candidates: list[bytes], landing: Sequence[bytes] = (),
               submitted: Optional[float] = None) -> Prefetched:
        """Look up the leading run of `candidates` the store holds, then load it;
        first wait for the `landing` blocks, which a prefill is still writing."""
        result = self._fetch_now(first, candidates, landing)
        if submitted is not None:
            self.stats.observe("load_fetch", time.monotonic() - submitted)
        return result

    def _fetch_now(self, first: int, candidates: list[bytes], landing: Sequence[bytes]) -> Prefetched:
        try:
            if landing:
                self._wait_for_writes([block_key(h) for h in landing])
            n = self._num_leading_present(candidates)
        except Exception as exc:
            log.warning("KV store lookup failed, computing locally: %s", exc)
            return Prefetched(first_block=first, failure="lookup")
        if n == 0:
            return Prefetched(first_block=first)
        # Prefetches leave a quarter of the arena to the saves: requests waiting
        # for admission must not take every slot a step's saves need.
        return self._load(first, candidates[:n], keep_free=self.arena.num_slots // 4, wait_s=PREFETCH_SLOT_WAIT_S)

    def _wait_for_writes(self, keys: list[str]) -> None:
        """Until the store holds every key, for WRITE_WAIT_S at most (then the
        lookup takes what landed). Raises when the store cannot be asked."""
        started = time.monotonic()
        pause = WRITE_POLL_S[0]
        while True:
            missing = [k for k, present in zip(keys, self.client.exists(keys)) if not present]
            if not missing:
                break
            if time.monotonic() - started + pause > WRITE_WAIT_S:
                log.warning("KV store: %d of %d blocks a prefill was writing had not landed after %.1fs; "
                            "computing what is missing", len(missing), len(keys), WRITE_WAIT_S)
                with self._stats_lock:  # two loader threads count here
                    self.stats.write_wait_timeouts += 1
                break
            time.sleep(pause)
            pause = min(pause * 2, WRITE_POLL_S[1])
            keys = missing
        waited = time.monotonic() - started
        self.stats.observe("load_write_wait", waited)
        with self._stats_lock:
            self.stats.write_wait_seconds += waited

    def _load(self, first: int, hashes: list[bytes], keep_free: int = 0, wait_s: float = 0.0) -> Prefetched:
        """These blocks from the store: pinned in its own slots where it lends
        them, else read into arena slots (every layer of each)."""
        if self._slots_usable():
            lent = self._pin(first, hashes)
            if lent is not None:
                return lent
        started = time.monotonic()
        slot = self.arena.alloc(len(hashes), wait_s=wait_s, keep_free=keep_free)
        allocated = time.monotonic()
        self.stats.observe("load_slot_wait", allocated - started)
        if slot is None:
            log.warning("KV staging arena full (%d slots): computing %d blocks locally",
                        self.arena.num_slots, len(hashes))
            return Prefetched(first_block=first, failure="load")
        out = Prefetched(first_block=first, arena=self.arena, slot=slot, hashes=list(hashes))
        try:
            found = self.client.get(self.arena.items([block_key(h) for h in hashes], slot))
            if not all(found):
                raise KeyError("evicted from the store between lookup and load")
            self.stats.observe("load_get", time.monotonic() - allocated)
            if not self.arena.headers_ok(slot, len(hashes)):
                raise ValueError("a block of another model, dtype or block size")
        except Exception as exc:  # store down, evicted, or a foreign block format
            out.release()
            log.warning("KV load failed, computing locally: %s", exc)
            return Prefetched(first_block=first, failure="load")
        out.seconds = time.monotonic() - started
        return out

    def _pin(self, first: int, hashes: list[bytes]) -> Optional[Prefetched]:
        """Pin these blocks' values in the store's slots (None: some are not
        lent, e.g. in private memory: the arena path loads them instead)."""
        started = time.monotonic()
        try:
            lease = self.slots.pin([block_key(h) for h in hashes], self._value_bytes)
        except Exception as exc:
            log.warning("KV load failed, computing locally: %s", exc)
            return Prefetched(first_block=first, failure="load")
        if lease.num_lent < len(hashes):
            lease.release()
            return None
        out = Prefetched(first_block=first, lease=lease, hashes=list(hashes))
        try:
            for view in lease.views:
                check_block_header(view[:HEADER_BYTES], self.layout.dtype, self.arena.block_shape)
        except BlockFormatError as exc:
            out.release()
            log.warning("KV load failed, computing locally: a block of another model, dtype or block size (%s)",
                        exc)
            return Prefetched(first_block=first, failure="load")
        out.seconds = time.monotonic() - started
        self.stats.observe("load_get", out.seconds)
        return out

    def _slots_usable(self) -> bool:
        return self.slots is not None and self.slots.usable()

    def _slot_block(self, view: memoryview) -> torch.Tensor:
        """A lent slot's block data as [layers, 2, block_size, kv_heads, head_dim] over the slot."""
        raw = torch.frombuffer(view, dtype=torch.uint8)[HEADER_BYTES:]
        return raw.view(self.layout.dtype).view(self.arena.block_shape)

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
        self._drop_prefetch(request.request_id, keep=result if num_external_tokens > 0 else None)
        if num_external_tokens <= 0:
            return
        last = first + num_external_tokens // self.block_size
        load = StoreLoad(request.request_id, list(block_ids[first:last]), request.block_hashes[first:last])
        if result is not None:
            load.prefetched, load.offset = result, first - result.first_block
        self._admitted.append(load)

    def _drop_prefetch(self, request_id: str, keep: Optional[Prefetched] = None) -> None:
        """Forget a request's prefetch; its slots go back unless `keep` is it (a
        planned load frees them once copied). A fetch still running frees its
        own when it ends."""
        fut = self._prefetches.pop(request_id, None)
        if fut is None:
            return
        if not fut.cancel():
            def release(done: Future) -> None:
                if not done.cancelled() and done.result() is not keep:
                    done.result().release()
            fut.add_done_callback(release)

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
                written = self._written.get(request_id)
                self._written[request_id] = (first, last) if written is None else (written[0], last)
        return meta

    def request_finished(self, request, block_ids) -> tuple[int, dict]:
        self._drop_prefetch(request.request_id)
        written = self._written.pop(request.request_id, None)
        if written is None:
            return 0, {}
        return 0, {WRITE_KEY: (written[0], written[1] - written[0])}

    # ---- worker side ---------------------------------------------------
    def register_kv_cache(self, kv_cache: torch.Tensor, view=None) -> None:
        super().register_kv_cache(kv_cache, view)
        if kv_cache.is_cuda:
            self.arena.pin()
        lend = self.slots_policy == "on" or (self.slots_policy == "auto" and kv_cache.is_cuda)
        opener = getattr(self.client, "lent_slots", None)
        if lend and opener is not None:
            cuda = kv_cache.is_cuda
            self.slots = opener(pin_memory=_pin_for_cuda if cuda else None,
                                unpin_memory=unpin_host_memory if cuda else None, observe=self.stats.observe)
            # Every slab the store has, mapped and page-locked before this engine serves: about 47 ms
            # a 256 MiB slab on the H200 host (9 s for a 48 GiB store), which no transfer should wait for.
            started = time.monotonic()
            if self.slots.map_all(timeout_s=SLOTS_MAP_TIMEOUT_S):
                log.info("KV store slots: every slab of the store mapped in %.1f s", time.monotonic() - started)

    def start_load(self, meta: StoreMeta) -> set[str]:
        failed: set[str] = set()
        for load in meta.loads:
            if load.prefetched is None:  # not fetched in the background: fetch now, inside the step
                load.prefetched = self._load(0, load.block_hashes)
                if load.prefetched.failure is not None:
                    failed.add(load.request_id)
                    self.stats.load_failures += 1
                    continue
            copied = None
            try:
                copied = self._copy_in(load)
            finally:
                if copied is None:
                    load.prefetched.release()
                else:  # its slots go back once the copies out of them are done
                    self._releaser.submit(_release_after, copied, load.prefetched)
        return failed

    def _copy_in(self, load: StoreLoad) -> Optional["torch.cuda.Event"]:
        """Queue the load's blocks into the cache; on a GPU, returns the event
        after which its staging slots may be reused (the engine thread does not
        wait for the copies: the step's kernels wait for them on the device)."""
        started = time.monotonic()
        result, offset, k = load.prefetched, load.offset, len(load.block_ids)
        assert result.hashes[offset:offset + k] == load.block_hashes, "prefetch does not match the load"
        cache = self.cache_view  # whole blocks: [layers, 2, blocks, block_size, kv_heads, head_dim]
        ids = torch.tensor(load.block_ids, device=cache.device)
        staged = None  # the arena's run of slots, [k, layers, 2, ...]: one tensor
        if result.lease is not None:  # the store's own slots: one copy per block straight from them
            sources = [self._slot_block(view) for view in result.lease.views[offset:offset + k]]
            self.stats.load_blocks_lent += k
        else:
            staged = self.arena.blocks[result.slot + offset:result.slot + offset + k]
            sources = list(staged.unbind(0))
        copied = None
        if cache.device.type == "cuda" and (result.lease is not None or self.arena.pinned):
            # One DMA per block from page-locked memory (a slab, or the pinned arena, whose
            # slots' data is contiguous but a run's is not: headers sit between), queued in
            # one call on the load stream, then one scatter on the device. Waiting for the
            # DMAs here held every running request for 8.6 ms per 272 MiB load (H200); on
            # the compute stream they ran between the step before and this one (6 ms). On a
            # stream of their own they run beside the step before, which is still on the GPU
            # when this one is queued (asynchronous scheduling); this step waits for them.
            compute = torch.cuda.current_stream(cache.device)
            if self._load_stream is None:
                self._load_stream = torch.cuda.Stream(cache.device)
            with torch.cuda.stream(self._load_stream):
                # Allocated in the load stream's order: no pending kernel of another stream uses it.
                on_device = torch.empty((k, *self.arena.block_shape), dtype=cache.dtype, device=cache.device)
                torch._foreach_copy_(list(on_device.unbind(0)), sources, non_blocking=True)
                copied = self._load_stream.record_event()
            compute.wait_event(copied)
            on_device.record_stream(compute)  # its memory is reused only after the scatter below
            cache.write_blocks(ids, on_device.permute(1, 2, 0, 3, 4, 5))
        else:
            staged = torch.stack(sources) if staged is None else staged
            cache.write_blocks(ids, staged.permute(1, 2, 0, 3, 4, 5).to(cache.device, non_blocking=True))
        self._count_load(result, k, started)
        return copied

    def _count_load(self, result: Prefetched, k: int, started: float) -> None:
        self.stats.load_blocks += k
        self.stats.load_bytes += k * self.layout.block_bytes
        self.stats.load_seconds += result.seconds * k / result.num_blocks
        self.stats.observe("load_copy_in", time.monotonic() - started)

    def save_layer(self, layer: int, meta: StoreMeta) -> None:
        if not meta.saves:
            return
        started = time.monotonic()
        if layer == 0:
            self._save_started = started
            if not self._start_saves(meta):
                return
            started = time.monotonic()
        if meta.save_slot < 0 and not meta.lent_saves:
            return
        # [n, 2, block_size, heads, dim]
        layer_kv = self.cache_view.layer_blocks(layer, meta.save_block_ids).transpose(0, 1)
        if meta.save_on_device is not None:
            meta.save_on_device[:, layer] = layer_kv  # on the device: no wait here
        else:
            self.arena.blocks[meta.save_slot:meta.save_slot + meta.num_save_blocks, layer].copy_(layer_kv)
        if layer == self.layout.num_layers - 1:
            keys = [block_key(h) for s in meta.saves for h in s.block_hashes]
            step = _StepSave(staged_at=self._save_started, pieces=-(-len(keys) // PUT_CHUNK_BLOCKS))
            if meta.lent_saves:
                self._submit_lent_saves(meta, step)
            else:
                copied = self._copy_to_arena(meta) if meta.save_on_device is not None else None
                for i in range(0, len(keys), PUT_CHUNK_BLOCKS):
                    self._saves.append(self._saver.submit(
                        self._put, keys[i:i + PUT_CHUNK_BLOCKS], meta.save_slot + i, step, copied))
        meta.stage_seconds += time.monotonic() - started
        if layer == self.layout.num_layers - 1:
            self.stats.observe("save_stage", meta.stage_seconds)

    def _start_saves(self, meta: StoreMeta) -> bool:
        """Layer 0 of a step with saves: room for them, in the store's own
        slots (gathered on the cache's device first) or in the arena.
        False: no room within SAVE_SLOT_WAIT_S, and this step's saves are dropped."""
        started = time.monotonic()
        self._abandon_unfinished_lent()
        n = sum(len(s.block_ids) for s in meta.saves)
        device = self.cache_view.device
        if self._slots_usable():
            meta.lent_saves = self._lent_budget.acquire(n, wait_s=SAVE_SLOT_WAIT_S)
            ok = meta.lent_saves
        else:
            slot = self.arena.alloc(n, wait_s=SAVE_SLOT_WAIT_S)
            ok = slot is not None
            if ok:
                meta.save_slot = slot
                self.arena.write_headers(slot, n)
        self.stats.observe("save_slot_wait", time.monotonic() - started)
        if not ok:
            # The decode computes what is not stored: slower, never wrong.
            log.warning("KV staging has no room for %d blocks: this step's saves are dropped", n)
            self.stats.save_failures += 1
            for save in meta.saves:  # nothing of theirs is landing: a decode must not wait for it
                self._written.pop(save.request_id, None)
            return False
        meta.num_save_blocks = n
        meta.save_block_ids = torch.tensor(meta.saved_block_ids(), device=device)
        if meta.lent_saves:
            self._reserve_lent(meta)
        if meta.lent_saves or self.arena.pinned:
            meta.save_on_device = torch.empty((n, *self.arena.block_shape), dtype=self.cache_view.dtype,
                                              device=device)
        return True

    def _reserve_lent(self, meta: StoreMeta) -> None:
        """Layer 0: ask the store for slots for each piece of the step's saves,
        on threads of their own, while the layers run (the keys are known)."""
        keys = [block_key(h) for s in meta.saves for h in s.block_hashes]
        meta.lent_reservations = [self._reserver.submit(self._reserve, keys[i:i + PUT_CHUNK_BLOCKS])
                                  for i in range(0, len(keys), PUT_CHUNK_BLOCKS)]
        self._unfinished_lent = (meta.lent_reservations, len(keys))

    def _reserve(self, keys: list[str]):
        started = time.monotonic()
        lease = self.slots.reserve(keys, self._value_bytes)
        self.stats.observe("save_reserve", time.monotonic() - started)
        return lease

    def _abandon_unfinished_lent(self) -> None:
        """A step that reserved slots and never reached its last layer (it
        failed): its reservations go back, and so does its budget."""
        if self._unfinished_lent is None:
            return
        reservations, n = self._unfinished_lent
        self._unfinished_lent = None
        for reservation in reservations:
            reservation.add_done_callback(lambda done: done.exception() is None and done.result().release())
        self._lent_budget.release(n)

    def _submit_lent_saves(self, meta: StoreMeta, step: "_StepSave") -> None:
        """The last layer: each piece's gathered blocks into its reserved slots.
        The copies are queued here, on the engine thread (on a GPU, one DMA per
        block on a stream of their own, after the gather): a saver thread
        queueing them would wait for this thread's GIL once per block. A saver
        thread then waits for them and commits the piece."""
        gathered, meta.save_on_device = meta.save_on_device, None
        cuda = gathered.is_cuda
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(gathered.device)
        ready = torch.cuda.current_stream(gathered.device).record_event() if cuda else None
        for piece, reservation in enumerate(meta.lent_reservations):
            first = piece * PUT_CHUNK_BLOCKS
            n = min(PUT_CHUNK_BLOCKS, gathered.shape[0] - first)
            waited = time.monotonic()
            try:
                lease = reservation.result(timeout=SAVE_SLOT_WAIT_S)
            except Exception as exc:
                self._lent_save_failed(exc, n, step)
                continue
            finally:
                self.stats.observe("save_reserve_wait", time.monotonic() - waited)
            try:
                if lease.num_lent < n:
                    self.slots.set_aside(f"the store had no slot to lend for {n - lease.num_lent} of {n} blocks "
                                         "(its /dev/shm is full?)")
                copied = self._fill_slots(gathered[first:first + n], lease.views, ready)
            except Exception as exc:
                lease.release()
                self._lent_save_failed(exc, n, step)
                continue
            self._saves.append(self._saver.submit(self._commit_lent, lease, copied, n, step))
        meta.lent_reservations = []
        self._unfinished_lent = None
        if cuda:  # its memory must not be reused before the copies out of it are done
            gathered.record_stream(self._copy_stream)

    def _fill_slots(self, blocks: torch.Tensor, views: list, ready: Optional["torch.cuda.Event"]
                    ) -> Optional["torch.cuda.Event"]:
        """blocks[i] (and its header) into slot views[i], where lent. On a GPU
        the copies are queued after `ready` and the returned event marks them
        done; on the CPU they are done on return."""
        targets = [(i, torch.frombuffer(view, dtype=torch.uint8)) for i, view in enumerate(views) if view is not None]
        for _, slot in targets:
            slot[:HEADER_BYTES] = self._header
        into = [slot[HEADER_BYTES:].view(blocks.dtype).view(blocks.shape[1:]) for _, slot in targets]
        out_of = [blocks[i] for i, _ in targets]
        if ready is None:
            torch._foreach_copy_(into, out_of)  # one call for all: one GIL release, not one per block
            return None
        return self._queue_to_host(into, out_of, ready)

    def _queue_to_host(self, into: list[torch.Tensor], out_of: list[torch.Tensor],
                       ready: "torch.cuda.Event") -> "torch.cuda.Event":
        """Queue out_of[i] (device) -> into[i] (page-locked host), one DMA each in one call,
        on the connector's copy stream after `ready`, so they run beside the next step's
        kernels instead of ahead of them; returns the event that marks them done."""
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(ready)
            torch._foreach_copy_(into, out_of, non_blocking=True)
            return self._copy_stream.record_event()

    def _commit_lent(self, lease, copied: Optional["torch.cuda.Event"], n: int, step: "_StepSave") -> None:
        """On a saver thread: once a piece's copies are done, its slots become values."""
        stored = 0
        try:
            if copied is not None:
                started = time.monotonic()
                copied.synchronize()  # waits without the GIL
                self.stats.observe("save_copy", time.monotonic() - started)
            started = time.monotonic()
            stored = lease.commit()
            self.stats.observe("save_put", time.monotonic() - started)
            with self._stats_lock:
                self.stats.save_blocks_lent += stored
        except Exception as exc:  # the decode side will recompute; never fail the request
            lease.release()
            log.warning("KV save failed: %s", exc)
            with self._stats_lock:
                self.stats.save_failures += 1
        finally:
            self._lent_budget.release(n)
        self._count_saved(stored, step)

    def _lent_save_failed(self, exc: Exception, n: int, step: "_StepSave") -> None:
        log.warning("KV save failed: %s", exc)
        with self._stats_lock:
            self.stats.save_failures += 1
        self._lent_budget.release(n)
        self._count_saved(0, step)

    def _copy_to_arena(self, meta: StoreMeta) -> "torch.cuda.Event":
        """Queue the step's gathered blocks' copies into their pinned slots (one
        DMA per block: headers sit between the slots); returns the event that
        marks them done."""
        device = self.cache_view.device
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        gathered = torch.cuda.current_stream(device).record_event()
        on_device, meta.save_on_device = meta.save_on_device, None
        slots = self.arena.blocks[meta.save_slot:meta.save_slot + meta.num_save_blocks]
        copied = self._queue_to_host(list(slots.unbind(0)), list(on_device.unbind(0)), gathered)
        # The allocator must not hand its memory to the compute stream before these copies are done.
        on_device.record_stream(self._copy_stream)
        return copied

    def _put(self, keys: list[str], slot: int, step: "_StepSave", copied=None) -> None:
        """Store one piece of a step's staged blocks (on a saver thread), once
        `copied` (a CUDA event, when the copies into the arena were queued)
        has passed. Its slots go back either way."""
        stored = 0
        try:
            if copied is not None:
                started = time.monotonic()
                copied.synchronize()
                self.stats.observe("save_copy", time.monotonic() - started)
            started = time.monotonic()
            stored = self.client.put(self.arena.items(keys, slot))
            self.stats.observe("save_put", time.monotonic() - started)
        except Exception as exc:  # the decode side will recompute; never fail the request
            log.warning("KV save failed: %s", exc)
            with self._stats_lock:
                self.stats.save_failures += 1
        finally:
            self.arena.free(slot, len(keys))
        self._count_saved(stored, step)

    def _count_saved(self, stored: int, step: "_StepSave") -> None:
        with self._stats_lock:
            self.stats.save_blocks += stored
            self.stats.save_bytes += stored * self.layout.block_bytes
            step.pieces -= 1
            if step.pieces == 0:  # the step's last piece: from its first staged layer until all stored
                self.stats.save_seconds += time.monotonic() - step.staged_at

    def wait_for_save(self) -> None:
        """The step's saves are staged (save_layer copied every layer): the
        step ends here, and the puts go on in the background."""
        self._saves = [fut for fut in self._saves if not fut.done()]

    def close(self) -> None:
        self._abandon_unfinished_lent()
        self._releaser.shutdown(wait=True)
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=True)
        self._reserver.shutdown(wait=True)
        if self.slots is not None:
            self.slots.close()
        self.arena.unpin()
        self.client.close()
