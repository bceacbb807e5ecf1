"""Memory for the memory backend's values: fixed-size slots cut out of large
anonymous mappings (slabs), each slab faulted in once by a thread of its own
before any value lands in it, then cut into slots of one value size and
reused for as long as the store runs.

Why not a buffer per value: on the H200 host, under a serving load, the
store's copies of values in and out of engines' arenas spent more than half
of their wall time off the CPU (tandem:kvstore_copy_seconds_total, wall
against thread_cpu), with the GIL held 3% of the time: every fresh value took
a page fault per 4 KiB while it was filled, and every mapping made or dropped
took the process's memory-map lock, which those faults wait for. A slab is
mapped once, faulted in ahead (AHEAD_BYTES of them kept ready, by
FILL_THREADS threads, without the GIL), and never unmapped while the store
runs: its memory grows to what its values need, at most max_bytes, and stays.

Values smaller than MIN_SLOT_BYTES are plain bytearrays (unless a slot is
asked for: take(size, slot=True)). Once the slabs reach max_bytes, a value
size with no free slot gets a fresh mapping per value (counted: num_fresh),
as every value did before.

Shared slabs (shared=True): each slab is a named segment in /dev/shm, so an
engine on the store's host can map it and copy a block between its GPU and a
slot directly (data_wire's RESERVE/COMMIT and PIN/RELEASE): one DMA each
way, no copy through the engine's staging arena. A segment ends with the
store's token, which the engine checks before using it (another pod's
/dev/shm may hold a segment of that name). Where /dev/shm has no room for a
slab, that slab is private memory and its slots are simply not lent.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

from tandem.services.kvstore.shared_arena import SHM_DIR, TOKEN_BYTES  # segments and their tokens, as the arena's

SLAB_BYTES = 256 * 1024 * 1024
AHEAD_BYTES = 2 * 1024 * 1024 * 1024  # faulted-in slabs kept ready: more than a prefill step's saves
FILL_THREADS = 2  # one faults in 2-3 GB/s; a serving store takes 4-5 GB/s in bursts
MIN_SLOT_BYTES = 256 * 1024
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+ (Python names it only from 3.13 on)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

Buffer = Union[memoryview, bytearray, mmap.mmap]
SLAB_PREFIX = "tandem-kvslab-"

log = logging.getLogger(__name__)


@dataclass
class Slab:
    """One slab: its mapping, and the /dev/shm segment it lives in (None: private memory)."""

    map: mmap.mmap
    name: Optional[str] = None
    index: int = -1  # its key in ValueSlabs.slabs, given when it is made


@dataclass
class _SizeClass:
    size: int
    free: list[memoryview] = field(default_factory=list)


@dataclass(frozen=True)
class SlotPlace:
    """Where a slot lies: its slab's index in ValueSlabs.slabs and the byte offset in it."""

    slab: int
    offset: int


class ValueSlabs:
    """Invariants (under `_lock`): slab_bytes counts every slab mapped (ready,
    being filled, or cut into slots) and never exceeds max_bytes; a slot
    handed out by take() and not given back has exactly one holder."""

    def __init__(self, max_bytes: int, slab_bytes: int = SLAB_BYTES, ahead_bytes: int = AHEAD_BYTES,
                 fill_threads: int = FILL_THREADS, shared: bool = False) -> None:
        self.max_bytes = max_bytes
        self.slab_size = slab_bytes
        self.ahead_bytes = min(ahead_bytes, max_bytes)
        self.slab_bytes = 0
        self.num_fresh = 0  # values that got a fresh mapping (no slot could be had)
        # Shared slabs: segment names start with SLAB_PREFIX, then this process's
        # id (so a later store can remove what a killed one left: sweep_dead_slabs).
        self.shared = shared
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._name_prefix = f"{SLAB_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._names = itertools.count(1)  # next() is atomic under the GIL: no lock needed
        self._said_private = False
        self._ready: list[Slab] = []  # faulted in, not yet cut into slots
        self._classes: dict[int, _SizeClass] = {}
        # id(slot) -> (its class, where it lies). Slots are made once (in _cut) and then
        # live in a free list or with a holder, so an id names one slot; a slot a holder
        # drops without giving it back is lost to reuse, and its id may then name a newer slot.
        self._slots: dict[int, tuple[_SizeClass, SlotPlace]] = {}
        # Every slab made (ready or cut into slots), kept mapped, by Slab.index. Ready
        # ones are listed too, so an engine can map and pin a slab before a slot of it is lent.
        self.slabs: dict[int, Slab] = {}
        self._indexes = itertools.count()
        self._lock = threading.Condition()
        self._closed = False
        self._filling = 0  # slabs the fillers are faulting in now
        self._fillers = [threading.Thread(target=self._fill, name=f"kvstore-slabs-{i}", daemon=True)
                         for i in range(fill_threads if self.ahead_bytes >= slab_bytes else 0)]
        for filler in self._fillers:
            filler.start()

    def take(self, size: int, slot: bool = False) -> Optional[Buffer]:
        """A writable buffer of `size` bytes, its contents undefined. slot=True:
        a slot of a slab even below MIN_SLOT_BYTES (a value to lend), or None
        when no slot is free and no more slabs may be made."""
        if size < MIN_SLOT_BYTES and not (slot and size > 0):
            return bytearray(size)
        if size > self.slab_size:
            if slot:
                return None
            with self._lock:
                self.num_fresh += 1
            return mmap.mmap(-1, size)
        with self._lock:
            cls = self._classes.get(size)
            if cls is None:
                cls = self._classes[size] = _SizeClass(size)
            making = False
            if not cls.free:
                if self._ready:
                    self._cut(cls, self._ready.pop(0))  # the oldest: engines have likely mapped it by now
                    self._lock.notify_all()  # a filler makes the next one
                elif self.slab_bytes + self.slab_size <= self.max_bytes and not self._closed:
                    # The puts got ahead of the fillers: a slab now (its room taken here), made
                    # outside the lock (a shared one is allocated first: about 0.1 s for 256 MiB),
                    # its pages faulted by the copies.
                    self.slab_bytes += self.slab_size
                    making = True
            if cls.free:
                return cls.free.pop()
        if making:
            slab = self._new_slab()
            with self._lock:
                if not self._closed:
                    self._listed(slab)
                    self._cut(cls, slab)
                    return cls.free.pop()
            _unlink(slab.name)
        if slot:
            return None
        with self._lock:
            self.num_fresh += 1
        return mmap.mmap(-1, size)

    def give(self, buffer: Buffer) -> bool:
        """Take back a slot nobody refers to any more (False: not a slot)."""
        with self._lock:
            entry = self._slots.get(id(buffer)) if type(buffer) is memoryview else None
            if entry is None or self._closed or len(buffer) != entry[0].size:
                return False
            entry[0].free.append(buffer)
            return True

    def place(self, buffer: Buffer) -> Optional[SlotPlace]:
        """Where a slot handed out by take() lies, when its slab is shared (None otherwise)."""
        with self._lock:
            entry = self._slots.get(id(buffer)) if type(buffer) is memoryview else None
            if entry is None or len(buffer) != entry[0].size:
                return None
            slab = self.slabs[entry[1].slab]
            # The id names this slot only while the slot lives (see _slots): check it is a view of that slab.
            if slab.name is None or buffer.obj is not slab.map:
                return None
            return entry[1]

    def shared_slabs(self) -> list[tuple[int, str, int]]:
        """(index, segment name, bytes) of every shared slab cut so far."""
        with self._lock:
            return [(slab.index, slab.name, len(slab.map)) for slab in self.slabs.values() if slab.name is not None]

    @property
    def complete(self) -> bool:
        """Whether no more slabs will be made (all of max_bytes is mapped)."""
        with self._lock:
            return self._filling == 0 and self.slab_bytes + self.slab_size > self.max_bytes

    @property
    def num_free(self) -> int:
        """Free slots already cut (ready slabs not counted)."""
        with self._lock:
            return sum(len(c.free) for c in self._classes.values())

    @property
    def ready_bytes(self) -> int:
        with self._lock:
            return len(self._ready) * self.slab_size

    def close(self) -> None:
        """Forget every slab (their memory goes once the last value over it
        does) and remove the shared ones' names from /dev/shm."""
        with self._lock:
            self._closed = True
            slabs = list(self.slabs.values())
            self._classes.clear()
            self._slots.clear()
            self.slabs = {}
            self._ready.clear()
            self._lock.notify_all()
        for slab in slabs:
            _unlink(slab.name)

    # ---- slabs ---------------------------------------------------------------
    def _cut(self, cls: _SizeClass, slab: Slab) -> None:
        whole = memoryview(slab.map)
        for i in range(self.slab_size // cls.size):
            slot = whole[i * cls.size:(i + 1) * cls.size]
            self._slots[id(slot)] = (cls, SlotPlace(slab.index, i * cls.size))
            cls.free.append(slot)

    def _listed(self, slab: Slab) -> None:
        """Give a new slab its index (under _lock)."""
        slab.index = next(self._indexes)
        self.slabs[slab.index] = slab

    def _new_slab(self) -> Slab:
        if self.shared:
            name = f"{self._name_prefix}{next(self._names)}"
            try:
                return Slab(_new_shared_map(name, self.slab_size, self.token), name)
            except OSError as exc:
                if not self._said_private:
                    self._said_private = True
                    log.warning("KV store: no room in %s for a %.0f MiB slab (%s): values in private memory "
                                "are not lent to engines on this host (they go through the data channel)",
                                SHM_DIR, self.slab_size / 2**20, exc)
        slab = mmap.mmap(-1, self.slab_size)
        try:
            slab.madvise(MADV_HUGEPAGE)  # 2 MiB pages where the kernel has them: 512x fewer faults
        except (AttributeError, OSError):
            pass
        return Slab(slab)

    def _fill(self) -> None:
        """A filler thread: keeps ahead_bytes of faulted-in slabs ready, within max_bytes."""
        def wanted() -> bool:
            ahead = (len(self._ready) + self._filling) * self.slab_size
            return self._closed or (ahead < self.ahead_bytes and self.slab_bytes + self.slab_size <= self.max_bytes)
        while True:
            with self._lock:
                self._lock.wait_for(wanted)
                if self._closed:
                    return
                self.slab_bytes += self.slab_size  # counted now: the room is taken while it fills
                self._filling += 1
            slab = self._new_slab()
            _fault_in(slab.map, self.slab_size)
            with self._lock:
                self._filling -= 1
                if self._closed:
                    _unlink(slab.name)
                    return
                self._listed(slab)
                self._ready.append(slab)


def _new_shared_map(name: str, nbytes: int, token: bytes) -> mmap.mmap:
    """A new /dev/shm segment of nbytes and the token after them, mapped; its
    memory allocated now (posix_fallocate), so a full /dev/shm is an OSError
    here rather than a SIGBUS when a copy first touches a page."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes + TOKEN_BYTES)
            os.pwrite(fd, token, nbytes)
            return mmap.mmap(fd, nbytes)
        except OSError:
            os.unlink(path)
            raise
    finally:
        os.close(fd)


def _unlink(name: Optional[str]) -> None:
    if name is not None:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def sweep_dead_slabs() -> int:
    """Remove the shared slabs of stores that no longer run (a killed store
    cannot remove its own); returns how many. Names carry their store's pid."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(SLAB_PREFIX):
            continue
        pid = name[len(SLAB_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        _unlink(name)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fault_in(slab: mmap.mmap, nbytes: int) -> mmap.mmap:
    """Every page of the slab faulted in, without the GIL (ctypes calls release it)."""
    holder = ctypes.c_char.from_buffer(slab)
    address = ctypes.addressof(holder)
    if _libc.madvise(address, nbytes, MADV_POPULATE_WRITE) != 0:  # older kernels: touch every page
        ctypes.memset(address, 0, nbytes)
    del holder
    return slab
