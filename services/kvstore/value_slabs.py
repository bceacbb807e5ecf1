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

Values smaller than MIN_SLOT_BYTES are plain bytearrays. Once the slabs reach
max_bytes, a value size with no free slot gets a fresh mapping per value
(counted: num_fresh), as every value did before.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from dataclasses import dataclass, field
from typing import Union

SLAB_BYTES = 256 * 1024 * 1024
AHEAD_BYTES = 2 * 1024 * 1024 * 1024  # faulted-in slabs kept ready: more than a prefill step's saves
FILL_THREADS = 2  # one faults in 2-3 GB/s; a serving store takes 4-5 GB/s in bursts
MIN_SLOT_BYTES = 256 * 1024
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+ (Python names it only from 3.13 on)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

Buffer = Union[memoryview, bytearray, mmap.mmap]


@dataclass
class _SizeClass:
    size: int
    free: list[memoryview] = field(default_factory=list)


class ValueSlabs:
    """Invariants (under `_lock`): slab_bytes counts every slab mapped (ready,
    being filled, or cut into slots) and never exceeds max_bytes; a slot
    handed out by take() and not given back has exactly one holder."""

    def __init__(self, max_bytes: int, slab_bytes: int = SLAB_BYTES, ahead_bytes: int = AHEAD_BYTES,
                 fill_threads: int = FILL_THREADS) -> None:
        self.max_bytes = max_bytes
        self.slab_size = slab_bytes
        self.ahead_bytes = min(ahead_bytes, max_bytes)
        self.slab_bytes = 0
        self.num_fresh = 0  # values that got a fresh mapping (no slot could be had)
        self._ready: list[mmap.mmap] = []  # faulted in, not yet cut into slots
        self._classes: dict[int, _SizeClass] = {}
        # id(slot) -> its class. Slots are made once (in _cut) and then live in a
        # free list or with a holder, so an id names one slot; a slot a holder drops
        # without giving it back is lost to reuse, and its id may then name a newer slot.
        self._slots: dict[int, _SizeClass] = {}
        self._slabs: list[mmap.mmap] = []  # every slab, kept mapped
        self._lock = threading.Condition()
        self._closed = False
        self._filling = 0  # slabs the fillers are faulting in now
        self._fillers = [threading.Thread(target=self._fill, name=f"kvstore-slabs-{i}", daemon=True)
                         for i in range(fill_threads if self.ahead_bytes >= slab_bytes else 0)]
        for filler in self._fillers:
            filler.start()

    def take(self, size: int) -> Buffer:
        """A writable buffer of `size` bytes, its contents undefined."""
        if size < MIN_SLOT_BYTES:
            return bytearray(size)
        if size > self.slab_size:
            with self._lock:
                self.num_fresh += 1
            return mmap.mmap(-1, size)
        with self._lock:
            cls = self._classes.get(size)
            if cls is None:
                cls = self._classes[size] = _SizeClass(size)
            if not cls.free:
                if self._ready:
                    self._cut(cls, self._ready.pop())
                    self._lock.notify_all()  # a filler makes the next one
                elif self.slab_bytes + self.slab_size <= self.max_bytes and not self._closed:
                    # The puts got ahead of the fillers: a slab now, its pages faulted by the copies.
                    self.slab_bytes += self.slab_size
                    self._cut(cls, _new_slab(self.slab_size))
            if cls.free:
                return cls.free.pop()
            self.num_fresh += 1
        return mmap.mmap(-1, size)

    def give(self, buffer: Buffer) -> bool:
        """Take back a slot nobody refers to any more (False: not a slot)."""
        with self._lock:
            cls = self._slots.get(id(buffer)) if type(buffer) is memoryview else None
            if cls is None or self._closed or len(buffer) != cls.size:
                return False
            cls.free.append(buffer)
            return True

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
        """Forget every slab (their memory goes once the last value over it does)."""
        with self._lock:
            self._closed = True
            self._classes.clear()
            self._slots.clear()
            self._slabs.clear()
            self._ready.clear()
            self._lock.notify_all()

    # ---- slabs ---------------------------------------------------------------
    def _cut(self, cls: _SizeClass, slab: mmap.mmap) -> None:
        self._slabs.append(slab)
        whole = memoryview(slab)
        for i in range(len(slab) // cls.size):
            slot = whole[i * cls.size:(i + 1) * cls.size]
            self._slots[id(slot)] = cls
            cls.free.append(slot)

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
            slab = _fault_in(_new_slab(self.slab_size))
            with self._lock:
                self._filling -= 1
                if self._closed:
                    return
                self._ready.append(slab)


def _new_slab(nbytes: int) -> mmap.mmap:
    slab = mmap.mmap(-1, nbytes)
    try:
        slab.madvise(MADV_HUGEPAGE)  # 2 MiB pages where the kernel has them: 512x fewer faults
    except (AttributeError, OSError):
        pass
    return slab


def _fault_in(slab: mmap.mmap) -> mmap.mmap:
    """Every page of the slab faulted in, without the GIL (ctypes calls release it)."""
    holder = ctypes.c_char.from_buffer(slab)
    address = ctypes.addressof(holder)
    if _libc.madvise(address, len(slab), MADV_POPULATE_WRITE) != 0:  # older kernels: touch every page
        ctypes.memset(address, 0, len(slab))
    del holder
    return slab
