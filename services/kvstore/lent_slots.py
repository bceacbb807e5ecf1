"""Slots of the KV store's own memory, lent to an engine on the store's host
(engine.connector.base.StoreSlots): the engine maps the store's shared slabs
(value_slabs.py) and copies each block between its cache and a slot itself,
one DMA each way on a GPU, where the arena path copies every byte twice more
in host memory (engine to its arena, arena to the store's value; and back).

A save reserves slots (RESERVE), fills them and commits them (COMMIT): a
value becomes visible whole, once committed, never half-written. A load pins
the values' slots (PIN), copies out of them and releases them (RELEASE): the
store neither moves nor reuses a pinned slot meanwhile. Both are a Lease that
holds one data-channel connection from the first call to the last, because
the store ties reservations and pins to the connection: a lease whose engine
dies or whose connection drops ends by itself.

Mapping a slab and page-locking it for the GPU takes tens of milliseconds
(256 MiB), so a thread maps the store's slabs as the store makes them (it
lists those it has ready before lending a slot of them): a lease rarely
waits for one.

Usable only where the engine sees the store's /dev/shm (the same host, the
same pod or `tandem up`): each slab ends with the store's token, checked
before the slab is used. `usable()` says whether this store lends and its
slabs are here; the connector falls back to its staging arena otherwise.
"""
from __future__ import annotations

import logging
import mmap
import os
import queue
import socket
import ssl
import threading
import time
from typing import Callable, Optional, Sequence

from tandem.services.common.grpc_server import TLSConfig
from tandem.services.kvstore import data_wire as wire
from tandem.services.kvstore import held_gil_io
from tandem.services.kvstore.block_client import BlockStoreClient
from tandem.services.kvstore.client import KVStoreUnavailable
from tandem.services.kvstore.value_slabs import SHM_DIR, SLAB_PREFIX, TOKEN_BYTES

log = logging.getLogger(__name__)

# Leases at once (each holds a connection): a prefill's save pieces and a
# decode's loads waiting for admission. A lease past these waits for one.
MAX_LEASES = 256
# After the store said it lends nothing, or a reserve found no slot to lend:
# how long the connector uses its arena before this client asks again.
RETRY_S = 10.0
# Slabs of a store that went away (another token) are unmapped this long
# after, once no copy can still be reading them.
RETIRE_AFTER_S = 60.0
# How often the watcher asks the store for slabs it made since.
WATCH_S = 0.2


class _Slab:
    __slots__ = ("name", "map", "view", "pinned")

    def __init__(self, name: str, map_: mmap.mmap, pinned: bool) -> None:
        self.name, self.map, self.pinned = name, map_, pinned
        self.view = memoryview(map_)


class Lease:
    """Slots lent for one call's keys: `views[i]` is key i's slot (None where
    the store had none to lend, or, for a pin, no such value). Ends with
    commit() (a reservation) or release(); either gives the connection back."""

    def __init__(self, client: "LentSlots", sock: socket.socket, keys: list[str],
                 views: list[Optional[memoryview]], reserved: bool) -> None:
        self._client, self._sock = client, sock
        self.keys, self.views, self.reserved = keys, views, reserved
        self._done = False

    @property
    def num_lent(self) -> int:
        return sum(v is not None for v in self.views)

    def commit(self) -> int:
        """The reserved slots become their keys' values; returns how many were stored."""
        assert self.reserved, "commit() is for a reservation; a pin ends with release()"
        keys = [k for k, v in zip(self.keys, self.views) if v is not None]
        try:
            held_gil_io.sendall(self._sock, wire.request_header(wire.OP_COMMIT, keys))
            stored, _refused = wire.PUT_REPLY.unpack(wire.read_reply(self._sock, wire.PUT_REPLY.size))
        except (OSError, ssl.SSLError, wire.ProtocolError, wire.RemoteError) as exc:
            self._end(ok=False)
            raise KVStoreUnavailable(f"KV store at {self._client.target}: commit failed: {exc}") from exc
        self._end(ok=True)
        return stored

    def release(self) -> None:
        """End the lease: pins let go, reservations not committed go back. Never raises
        (a connection that fails here is closed, which ends them in the store too)."""
        if self._done:
            return
        try:
            held_gil_io.sendall(self._sock, wire.request_header(wire.OP_RELEASE, self.keys))
            wire.read_status(self._sock)
        except (OSError, ssl.SSLError, wire.ProtocolError, wire.RemoteError):
            self._end(ok=False)
            return
        self._end(ok=True)

    def _end(self, ok: bool) -> None:
        if not self._done:
            self._done = True
            self.views = [None] * len(self.views)
            self._client._give_back(self._sock, ok)


class LentSlots:
    """The store's slots, for an engine on its host. `pin_memory(view)`
    page-locks a newly mapped slab for the GPU (False: not possible, and
    then this client is not usable); `unpin_memory(view)` undoes it."""

    def __init__(self, target: str, timeout_s: float = 5.0, tls: Optional[TLSConfig] = None,
                 pin_memory: Optional[Callable[[memoryview], bool]] = None,
                 unpin_memory: Optional[Callable[[memoryview], None]] = None,
                 observe: Optional[Callable[[str, float], None]] = None) -> None:
        """observe(phase, seconds): told of each slab mapped ("slots_map")."""
        self.target = target
        self.timeout_s = timeout_s
        self._channel = BlockStoreClient(target, timeout_s=timeout_s, tls=tls)
        self._pin_memory, self._unpin_memory = pin_memory, unpin_memory
        self._lock = threading.Lock()  # the slab maps
        self._token: Optional[bytes] = None  # the store whose slabs are mapped in _slabs
        self._checked = False  # the store was asked since the last failure, and lends
        self._slabs: dict[int, _Slab] = {}
        self._retired: list[tuple[float, _Slab]] = []
        self._idle: "queue.LifoQueue[socket.socket]" = queue.LifoQueue()
        self._leases = threading.BoundedSemaphore(MAX_LEASES)
        self._unusable_until = 0.0  # monotonic: no lending asked before then
        self._why_not: Optional[str] = None
        self._observe = observe
        self._closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._store_state = wire.SLABS_GROWING  # data_wire.SLABS_*, as the store last said

    # ---- whether to use it ------------------------------------------------------
    def usable(self) -> bool:
        """Whether this store lends slots this engine can map; never raises.
        A store that lends nothing here (Redis, --no-shared-slabs, another
        host's /dev/shm) is asked again only after RETRY_S. One that cannot
        be reached is asked again at the next call: the arena path would fail
        as well, and a restarted store should be lending again at once."""
        if time.monotonic() < self._unusable_until:
            return False
        if self._checked:
            return True
        if self._ask() is None:
            return False
        self._checked = True
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="kv-slabs", daemon=True)
            self._watcher.start()
        return True

    def _ask(self) -> Optional[bool]:
        """Map the store's slabs now (_refresh on a connection of its own): True
        when that is all it will ever have, False when it may make more, None
        when it could not be asked or lends nothing here. A store that lends
        nothing here (Redis, --no-shared-slabs, another host's /dev/shm) is
        set aside for RETRY_S; one that cannot be reached is not (see usable)."""
        try:
            sock = self._borrow()
        except KVStoreUnavailable:
            return None
        try:
            complete = self._refresh(sock)
        except wire.RemoteError as exc:  # the store lends nothing (Redis, --no-shared-slabs)
            self._give_back(sock, ok=True)
            self._set_aside(str(exc))
            return None
        except (OSError, ssl.SSLError, wire.ProtocolError):  # the store went away mid-answer
            self._give_back(sock, ok=False)
            return None
        except ValueError as exc:  # its slabs are not here, or cannot be page-locked (after ProtocolError,
            self._give_back(sock, ok=True)  # which is one too)
            self._set_aside(str(exc))
            return None
        self._give_back(sock, ok=True)
        return complete

    def _watch(self) -> None:
        """Map (and page-lock) the store's slabs as it makes them, off the leases' path."""
        while not self._closed.wait(WATCH_S):
            if not self._checked:
                continue
            try:
                sock = self._borrow()
            except KVStoreUnavailable:
                continue
            try:
                self._refresh(sock)
            except (OSError, ssl.SSLError, wire.ProtocolError, wire.RemoteError, ValueError) as exc:
                self._give_back(sock, ok=False)
                log.debug("KV store at %s: mapping its slabs failed: %s", self.target, exc)
                continue
            self._give_back(sock, ok=True)

    def map_all(self, timeout_s: float) -> bool:
        """Map (and page-lock) every slab of the store now, waiting while it
        is still allocating them (a --preallocate store at start), up to
        timeout_s: an engine calls it before it serves, so that no transfer
        waits for a slab to be mapped and page-locked (about 47 ms a 256 MiB
        slab on the H200 host: 9 s for a 48 GiB store).
        True once all are mapped; False for a store that grows as values
        arrive (its later slabs are mapped by the watcher) or on failure."""
        if not self.usable():
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            complete = self._ask()
            if complete is None:
                return False
            if complete:
                return True
            if time.monotonic() > deadline or self._store_state != wire.SLABS_ALLOCATING:
                return False
            time.sleep(WATCH_S)

    def set_aside(self, why: str) -> None:
        """Use the arena for RETRY_S (e.g. a reserve found no slot to lend)."""
        self._set_aside(why)

    def _set_aside(self, why: str) -> None:
        self._checked = False
        self._unusable_until = time.monotonic() + RETRY_S
        if why != self._why_not:
            self._why_not = why
            log.info("KV store at %s: blocks go through the staging arena, not the store's own slots: %s",
                     self.target, why)

    # ---- leases -----------------------------------------------------------------
    def reserve(self, keys: Sequence[str], length: int) -> Lease:
        """A slot of `length` bytes for each key, to fill and commit."""
        return self._lease(wire.OP_RESERVE, list(keys), length)

    def pin(self, keys: Sequence[str], length: int) -> Lease:
        """Each key's value of `length` bytes, held in place until release()."""
        return self._lease(wire.OP_PIN, list(keys), length)

    def _lease(self, op: int, keys: list[str], length: int) -> Lease:
        sock = self._borrow()
        try:
            held_gil_io.sendall(sock, wire.request_header(op, keys) + wire.encode_lengths([length] * len(keys)))
            places = wire.decode_places(wire.read_reply(sock, wire.PLACE.size * len(keys)))
            unmapped = {slab for slab, _ in places if slab >= 0 and slab not in self._slabs}
            if unmapped:
                self._refresh(sock, unmapped)  # slabs the watcher has not mapped yet
            views = [self._view(slab, offset, length) for slab, offset in places]
        except (OSError, ssl.SSLError, wire.ProtocolError, wire.RemoteError, ValueError) as exc:
            self._give_back(sock, ok=False)  # the store ends the connection's reservations and pins
            raise KVStoreUnavailable(f"KV store at {self.target}: {wire.OPS[op]} failed: {exc}") from exc
        return Lease(self, sock, keys, views, reserved=op == wire.OP_RESERVE)

    def _view(self, slab: int, offset: int, length: int) -> Optional[memoryview]:
        if slab < 0:
            return None
        mapped = self._slabs.get(slab)
        if mapped is None or offset + length > len(mapped.view):
            raise ValueError(f"the store lent bytes {offset}..{offset + length} of slab {slab}, "
                             "which this engine has not mapped")
        return mapped.view[offset:offset + length]

    # ---- slabs ------------------------------------------------------------------
    def _refresh(self, sock: socket.socket, needed: Optional[set[int]] = None) -> bool:
        """Ask the store for its slabs and map those not mapped yet: all of them
        (the watcher), or only those in `needed` (a lease that found new ones).
        ValueError: they are not in this host's /dev/shm, or cannot be pinned.
        Each is mapped outside the lock, so a lease does not wait for the
        watcher's whole batch; two threads mapping one slab keep one mapping.
        True when every slab the store will ever have is mapped now."""
        sock.sendall(wire.request_header(wire.OP_SLABS, []))
        wire.read_status(sock)
        token = bytes(wire.recv_exactly(sock, TOKEN_BYTES))
        self._store_state = wire.recv_exactly(sock, 1)[0]
        complete = self._store_state == wire.SLABS_COMPLETE
        (count,) = wire.recv_struct(sock, wire.COUNT)
        listed = []
        for _ in range(count):
            index, size, name_len = wire.recv_struct(sock, wire.SLAB)
            listed.append((index, size, wire.recv_exactly(sock, name_len).decode()))
        with self._lock:
            if token != self._token:
                if self._token is not None:  # a restarted store: its predecessor's slabs retire
                    now = time.monotonic()
                    self._retired += [(now, slab) for slab in self._slabs.values()]
                    self._slabs = {}
                self._token = token
            self._retire_old()
        for index, size, name in listed:
            if index in self._slabs or (needed is not None and index not in needed):
                continue
            started = time.monotonic()
            slab = self._map(name, size, token)
            with self._lock:
                if self._token != token or index in self._slabs:
                    keep = None
                else:
                    keep = self._slabs[index] = slab
            if keep is None:  # mapped meanwhile by another thread, or the store changed
                self._unmap(slab)
            elif self._observe is not None:
                self._observe("slots_map", time.monotonic() - started)
        return complete and needed is None

    def _map(self, name: str, size: int, token: bytes) -> _Slab:
        if not name.startswith(SLAB_PREFIX) or "/" in name:
            raise ValueError(f"{name!r} is not a KV store slab")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError as exc:
            raise ValueError(f"the store's slab {name} is not in this host's {SHM_DIR} ({exc.strerror}): "
                             "the store runs on another host or pod") from None
        try:
            if os.fstat(fd).st_size < size + TOKEN_BYTES or os.pread(fd, TOKEN_BYTES, size) != token:
                raise ValueError(f"{SHM_DIR}/{name} here is not the store's (another pod's /dev/shm)")
            # MAP_POPULATE: the page table filled in one go (the store's pages exist), not by a fault per page.
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        slab = _Slab(name, mapped, pinned=False)
        if self._pin_memory is not None:
            if not self._pin_memory(slab.view):
                raise ValueError(f"cannot page-lock the store's slab {name} for the GPU")
            slab.pinned = True
        return slab

    def _retire_old(self) -> None:
        now = time.monotonic()
        keep = []
        for since, slab in self._retired:
            if now - since < RETIRE_AFTER_S:
                keep.append((since, slab))
            else:
                self._unmap(slab)
        self._retired = keep

    def _unmap(self, slab: _Slab) -> None:
        # Unpinned first: memory unmapped while still registered would leave the
        # registration behind, and a later mapping at that address could not be pinned.
        if slab.pinned and self._unpin_memory is not None:
            self._unpin_memory(slab.view)
            slab.pinned = False
        try:
            slab.view.release()
            slab.map.close()
        except BufferError:  # a tensor still refers to it: the garbage collector unmaps it later
            pass

    # ---- connections ------------------------------------------------------------
    def _borrow(self) -> socket.socket:
        if not self._leases.acquire(timeout=self.timeout_s):
            raise KVStoreUnavailable(f"KV store at {self.target}: {MAX_LEASES} leases of slots are all "
                                     f"held for {self.timeout_s:g}s")
        try:
            sock = self._idle.get_nowait()
        except queue.Empty:
            try:
                sock = self._channel._connect(attach=False)
            except (OSError, ssl.SSLError, wire.ProtocolError, KVStoreUnavailable) as exc:
                self._leases.release()
                self._channel._data_port = None
                raise KVStoreUnavailable(f"KV store at {self.target}: cannot open its data channel: {exc}") from exc
        return sock

    def _give_back(self, sock: socket.socket, ok: bool) -> None:
        if ok:
            self._idle.put(sock)
        else:
            sock.close()
            self._channel._data_port = None
            self._checked = False  # ask again: the store may have restarted
        self._leases.release()

    def close(self) -> None:
        """Close the connections (the store ends their leases) and unmap the slabs:
        call it once no copy to or from a slot is under way."""
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.timeout_s + 1)
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break
        self._channel.close()
        with self._lock:
            for slab in list(self._slabs.values()) + [slab for _, slab in self._retired]:
                self._unmap(slab)
            self._slabs, self._retired = {}, []
