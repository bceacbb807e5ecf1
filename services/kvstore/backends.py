"""Where the KV store keeps its blocks: a `Backend` is a map from string keys
to opaque bytes with batch operations. Two implementations:

- `MemoryBackend`: in-process, LRU, bounded by the bytes of the values it holds;
- `RedisBackend`: a real Redis server; Redis decides eviction itself.

Backends know nothing of gRPC; the server maps `BackendUnavailable` to the
UNAVAILABLE status code.
"""
from __future__ import annotations

import mmap
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, Sequence

from tandem.services.kvstore.value_slabs import AHEAD_BYTES, SLAB_BYTES, SlotPlace, ValueSlabs
from tandem.services.kvstore.redis_wire import BulkReplyReader, BulkValuePacker, ReplyError
from tandem.services.kvstore.redis_wire import ProtocolError as WireError


class BackendUnavailable(Exception):
    """The backend cannot be reached (e.g. Redis is down); the request may succeed later."""


@dataclass
class BackendStats:
    backend: str          # "memory" or "redis"
    bytes: int            # memory: value bytes held; redis: Redis's used_memory
    blocks: int           # values held
    capacity_bytes: int   # 0: unbounded
    hits: int             # keys found by get
    misses: int           # keys not found by get
    evictions: int        # values evicted to make room
    fresh_buffers: int = 0  # memory: values received into never-used memory (no ready buffer)


class Backend(Protocol):
    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Store each value under its key (replacing any old one); entry i says whether
        items[i] was stored (False: refused, e.g. larger than the capacity)."""

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """One entry per key, None where the key is missing."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence per key; moves no bytes and does not count as a use."""

    def delete(self, keys: Sequence[str]) -> int:
        """Remove the keys; returns how many were present."""

    def stats(self) -> BackendStats: ...

    def close(self) -> None: ...


class MemoryBackend:
    """LRU map bounded by bytes.

    Invariants (under `_lock`): `_bytes` is the sum of len(value) over
    `_values`, and `_bytes <= capacity_bytes`. `_values` is ordered from least
    to most recently used; put and get (of a present key) move a key to the
    end, exists does not (a probe is not a use). Keys are not counted in the
    bound: they are small next to KV blocks.
    """

    name = "memory"
    keeps_values = True  # the data channel receives into take_buffer()'s buffers, and they are kept

    def __init__(self, capacity_bytes: int, shared_slabs: bool = False, preallocate: bool = False) -> None:
        """shared_slabs: values live in /dev/shm segments that engines on this
        host may map, so blocks can be lent (value_slabs.py). preallocate: all
        of the capacity is allocated from the start, in the background (as a
        serving store's memory ends up anyway), so no put waits for a new slab
        and engines map every slab before they need it; otherwise a few GiB
        are kept ready ahead of the puts."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.preallocate = preallocate
        self._values: OrderedDict[str, bytes] = OrderedDict()
        # Values live in slots of slabs (value_slabs.py says why), reused as
        # values are replaced or evicted. A small store (tests, a laptop) maps
        # small slabs and keeps fewer ready; the slabs may exceed the capacity
        # by a few (puts under way hold new values before old ones are evicted,
        # and slabs are cut into slots of one size, leaving a remainder).
        slab = min(SLAB_BYTES, max(capacity_bytes // 16, 1 << 20))
        self._slabs = ValueSlabs(max_bytes=capacity_bytes + 4 * slab, slab_bytes=slab,
                                 ahead_bytes=(capacity_bytes + 4 * slab) if preallocate
                                 else min(AHEAD_BYTES, capacity_bytes // 8),
                                 shared=shared_slabs)
        # Slots of values dropped while a reader still had them: back to the
        # slabs once it lets go (looked at by take_buffer).
        self._pending: list[memoryview] = []
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        stored: list[bool] = []
        with self._lock:
            for key, value in items:
                # Refused before anything is evicted: storing it would empty
                # the whole store and still not fit.
                if len(value) > self.capacity_bytes:
                    stored.append(False)
                    continue
                old = self._values.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                    self._keep_spare(old)
                    del old
                while self._bytes + len(value) > self.capacity_bytes:
                    _, evicted = self._values.popitem(last=False)
                    self._bytes -= len(evicted)
                    self._evictions += 1
                    self._keep_spare(evicted)
                    del evicted
                # A bytes or bytearray value is kept as given (the data channel
                # received it into a buffer of its own: no second copy); the
                # caller must not change it afterwards.
                self._values[key] = (value if isinstance(value, (bytes, bytearray, mmap.mmap, memoryview))
                                     else bytes(value))
                self._bytes += len(value)
                stored.append(True)
        return stored

    def take_buffer(self, size: int):
        """A buffer of `size` bytes to receive a value into (then given to put)."""
        if self._pending:
            self._reclaim()
        return self._slabs.take(size)

    # ---- lending slots to engines on this host (data_wire's RESERVE/COMMIT, PIN/RELEASE) ----
    @property
    def lends_slots(self) -> bool:
        return self._slabs.shared

    @property
    def slab_token(self) -> bytes:
        return self._slabs.token

    def shared_slabs(self) -> list[tuple[int, str, int]]:
        return self._slabs.shared_slabs()

    @property
    def slabs_complete(self) -> bool:
        """Whether all of its capacity is allocated in slabs: no more will be made.
        Before that, a preallocate store is making them all now; another one
        makes them as values arrive."""
        return self._slabs.complete

    def reserve_slot(self, size: int) -> Optional[tuple[memoryview, SlotPlace]]:
        """A free slot in a shared slab for a value of `size` (None: none to
        lend); it becomes a value with put(), or goes back with unreserve().
        With every slot in use, the least recently used values are evicted
        until one frees, as a put makes room: reservations under way must
        not outgrow the slack the slabs have over the capacity."""
        if size <= 0 or size > self.capacity_bytes:
            return None
        while True:
            if self._pending:
                self._reclaim()
            slot = self._slabs.take(size, slot=True)
            if slot is not None:
                place = self._slabs.place(slot)
                if place is not None:
                    return slot, place
                self._slabs.give(slot)  # a slot of private memory: nothing to lend
                return None
            if not self._evict_oldest(size):
                return None

    def _evict_oldest(self, size: int) -> bool:
        """Evict the least recently used value of `size` bytes, whose slot fits
        (False: none left). Its slot frees now, or once its readers let go."""
        with self._lock:
            key = next((k for k, v in self._values.items() if len(v) == size), None)
            if key is None:
                return False
            evicted = self._values.pop(key)
            self._bytes -= len(evicted)
            self._evictions += 1
            self._keep_spare(evicted)
            del evicted
            return True

    def unreserve(self, slot: memoryview) -> None:
        """A reserved slot that never became a value."""
        self._slabs.give(slot)

    def pin(self, keys: Sequence[str], lengths: Sequence[int]) -> list[Optional[tuple[memoryview, SlotPlace]]]:
        """Each key's value and where it lies, when it is lengths[i] bytes in a
        shared slab (None otherwise). The caller's reference keeps the slot
        from reuse (_keep_spare) until it drops it. Counts as a get."""
        out: list[Optional[tuple[memoryview, SlotPlace]]] = []
        with self._lock:
            for key, length in zip(keys, lengths):
                value = self._values.get(key)
                place = self._slabs.place(value) if value is not None and len(value) == length else None
                if place is None:
                    self._misses += 1
                    out.append(None)
                    continue
                self._values.move_to_end(key)
                self._hits += 1
                out.append((value, place))
        return out

    def _keep_spare(self, value) -> None:
        # A slot is reused only when nothing else refers to it: a GET still
        # sending the old value holds a reference, and its bytes must not change
        # under it. sys.getrefcount counts the caller's name and its own argument.
        if type(value) is memoryview:
            if sys.getrefcount(value) <= 3:
                self._slabs.give(value)
            else:
                self._pending.append(value)

    def _reclaim(self) -> None:
        """Give back the pending slots their readers have let go of."""
        with self._lock:
            still = []
            for value in self._pending:
                # References: the list, this loop's name, getrefcount's argument.
                if sys.getrefcount(value) <= 3:
                    self._slabs.give(value)
                else:
                    still.append(value)
            self._pending = still

    def get(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        with self._lock:
            for key in keys:
                value = self._values.get(key)
                if value is None:
                    self._misses += 1
                else:
                    self._values.move_to_end(key)
                    self._hits += 1
                out.append(value)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        with self._lock:
            for key in keys:
                value = self._values.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)
                    deleted += 1
                    self._keep_spare(value)
                    del value
        return deleted

    def keys_lru_first(self) -> list[str]:
        """The keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._values)

    def stats(self) -> BackendStats:
        with self._lock:
            return BackendStats(backend=self.name, bytes=self._bytes, blocks=len(self._values),
                                capacity_bytes=self.capacity_bytes, hits=self._hits,
                                misses=self._misses, evictions=self._evictions,
                                fresh_buffers=self._slabs.num_fresh)

    def close(self) -> None:
        with self._lock:
            self._values.clear()
            self._pending.clear()
            self._bytes = 0
        self._slabs.close()


READ_SIZE = 4 * 1024 * 1024


class RedisBackend:
    """Blocks in a real Redis, one string key per block, keys exactly as given.

    Eviction is Redis's own: run Redis with `maxmemory` and a policy such as
    `allkeys-lru` so it drops old blocks instead of refusing writes (with the
    default `noeviction`, a full Redis makes put fail, which the server reports
    as UNAVAILABLE). Use a database of its own: `blocks` counts every key in it.

    Timeouts are short and retries few on purpose: a client of the store gives
    up after its own deadline and recomputes, so an unreachable Redis must be
    reported in about a second, not after redis-py's default backoff.
    """

    name = "redis"
    keeps_values = False  # a value's buffer is free again once put returns
    # Buffers of values read by get and handed back by release_values, kept
    # for the next get, at most this many bytes: fresh memory is zeroed and
    # page-faulted in (see value_slabs.py), reused memory not.
    SPARE_BYTES = 128 * 1024 * 1024
    # Keys per EXISTS/DEL/SET pipeline: bounds one round trip.
    BATCH_KEYS = 16
    # GETs in flight on one connection. Few: Redis copies each reply into an
    # output buffer of its own size, and with many 2 MiB replies waiting
    # (16 GETs on each of 4 connections) it spent 0.6 CPU-s per GB moved, mostly
    # page faults on fresh buffers, against 0.28 with 1 or 2.
    GET_PIPELINE_KEYS = 2

    def __init__(self, url: str, connect_timeout_s: float = 1.0, timeout_s: float = 5.0) -> None:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        self.url = url
        # One retry: after a Redis restart each pooled connection fails once on
        # its dead socket; the retry reconnects.
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
            # Blocks are MiBs: read replies in large pieces, not 64 KiB ones.
            socket_read_size=READ_SIZE,
            # Values go from their buffers straight to the socket (redis_wire.py says why).
            command_packer=BulkValuePacker(),
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._redis_error = redis.exceptions.RedisError
        self._hits = 0
        self._misses = 0
        self._counts_lock = threading.Lock()
        self._spare: dict[int, list[bytearray]] = {}  # size -> buffers nobody refers to
        self._spare_bytes = 0
        self._spare_lock = threading.Lock()

    def _call(self, what: str, fn):
        """Run fn(); Redis being unreachable (or refusing writes) becomes BackendUnavailable."""
        try:
            return fn()
        except (*self._errors, self._redis_error) as exc:
            raise self._unavailable(what, exc) from exc

    def _unavailable(self, what: str, exc: BaseException) -> BackendUnavailable:
        if isinstance(exc, (OSError, WireError, *self._errors)):  # OSError: socket timeouts too
            return BackendUnavailable(
                f"Redis at {self.url} is unreachable during {what} ({exc}); check that it runs "
                f"and the URL is right, or start the store with --backend memory")
        # e.g. OOM under maxmemory with noeviction, or WRONGTYPE
        return BackendUnavailable(f"Redis at {self.url} refused {what}: {exc}")

    @classmethod
    def _batches(cls, seq: Sequence):
        for i in range(0, len(seq), cls.BATCH_KEYS):
            yield seq[i:i + cls.BATCH_KEYS]

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        def run() -> list[bool]:
            for batch in self._batches(items):
                pipe = self._client.pipeline(transaction=False)
                for key, value in batch:
                    # redis-py takes bytes and memoryviews (not bytearrays): no copy either way.
                    pipe.set(key, value if isinstance(value, bytes) else memoryview(value))
                pipe.execute()
            return [True] * len(items)
        return self._call("put", run)

    def get(self, keys: Sequence[str]) -> list[Optional[bytearray]]:
        return list(self.iter_get(keys))

    def iter_get(self, keys: Sequence[str]) -> Iterator[Optional[bytearray]]:
        """The values of `keys` in order, each read straight into a buffer of its
        own (redis_wire.BulkReplyReader says why), while the next GETs are
        already with Redis: the caller sends value i on as Redis answers i+1.
        BackendUnavailable from the first value on; a caller that stops early
        must close() the iterator (a for loop or garbage collection does)."""
        if not keys:
            return
        pool = self._client.connection_pool
        conn, reader, first = self._start_gets(pool, keys)
        found = yielded = 0
        complete = False
        try:
            value = first
            sent = min(len(keys), self.GET_PIPELINE_KEYS)
            for read in range(1, len(keys) + 1):
                found += value is not None
                yielded += 1
                yield value
                if read == len(keys):
                    break
                if sent < len(keys):  # keep the window full before waiting on the next reply
                    conn.send_packed_command(conn.pack_commands([("GET", keys[sent])]))
                    sent += 1
                value = reader.read(self._take_buffer)
            if not reader.drained:
                raise WireError("Redis sent more than the replies asked for")
            complete = True
        except (OSError, WireError, ReplyError, self._redis_error) as exc:  # OSError: timeouts too
            raise self._unavailable("get", exc) from exc
        finally:
            if not complete:  # replies may still be on their way: the connection is out of step
                conn.disconnect()
            pool.release(conn)
            with self._counts_lock:
                self._hits += found
                self._misses += yielded - found

    def _start_gets(self, pool, keys: Sequence[str]):
        """(connection, reader, first value) with the first GETs sent."""
        # Twice: after a Redis restart a pooled connection fails once on its dead
        # socket, and the second try connects afresh (GET can be repeated).
        for attempt in (1, 2):
            conn = None
            try:
                conn = pool.get_connection()  # connects: raises if Redis is down
                window = keys[:self.GET_PIPELINE_KEYS]
                conn.send_packed_command(conn.pack_commands([("GET", key) for key in window]))
                # redis-py has no public handle on the socket; its parser holds no
                # bytes of ours (they are read here), so the connection stays usable.
                reader = BulkReplyReader(conn._sock)
                return conn, reader, reader.read(self._take_buffer)
            except (OSError, WireError, ReplyError, self._redis_error) as exc:
                if conn is not None:
                    conn.disconnect()
                    pool.release(conn)
                if attempt == 2 or not isinstance(exc, (OSError, WireError, *self._errors)):
                    raise self._unavailable("get", exc) from exc
        raise AssertionError("unreachable")

    def _take_buffer(self, size: int) -> bytearray:
        with self._spare_lock:
            spare = self._spare.get(size)
            if spare:
                self._spare_bytes -= size
                return spare.pop()
        return bytearray(size)

    def release_values(self, values: Sequence[Optional[bytearray]]) -> None:
        """The caller of get is done with these values (sent them on): their
        buffers may hold the next get's values. Values it still uses must not be passed."""
        with self._spare_lock:
            for value in values:
                if type(value) is bytearray and self._spare_bytes + len(value) <= self.SPARE_BYTES:
                    self._spare.setdefault(len(value), []).append(value)
                    self._spare_bytes += len(value)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # EXISTS of several keys returns only a count, so one EXISTS per key,
        # pipelined: one round trip per batch.
        def run() -> list[bool]:
            out: list[bool] = []
            for batch in self._batches(keys):
                pipe = self._client.pipeline(transaction=False)
                for key in batch:
                    pipe.exists(key)
                out.extend(bool(n) for n in pipe.execute())
            return out
        return self._call("exists", run)

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        return int(self._call("delete", lambda: sum(
            self._client.delete(*batch) for batch in self._batches(keys))))

    def stats(self) -> BackendStats:
        def run() -> tuple[dict, int]:
            return self._client.info(), self._client.dbsize()
        info, blocks = self._call("stats", run)
        with self._counts_lock:
            hits, misses = self._hits, self._misses
        return BackendStats(backend=self.name, bytes=int(info.get("used_memory", 0)), blocks=int(blocks),
                            capacity_bytes=int(info.get("maxmemory", 0)), hits=hits, misses=misses,
                            evictions=int(info.get("evicted_keys", 0)))

    def ping(self) -> None:
        """Raise BackendUnavailable unless Redis answers."""
        self._call("ping", self._client.ping)

    def close(self) -> None:
        self._client.close()


def open_backend(spec: str, capacity_bytes: int, shared_slabs: bool = False, preallocate: bool = False) -> Backend:
    """`memory` or a `redis://` / `rediss://` / `unix://` URL (shared_slabs, preallocate: see MemoryBackend)."""
    if spec == "memory":
        return MemoryBackend(capacity_bytes, shared_slabs=shared_slabs, preallocate=preallocate)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisBackend(spec)
    raise ValueError(f"unknown backend {spec!r}: use 'memory' or a URL such as redis://127.0.0.1:6379/0")
