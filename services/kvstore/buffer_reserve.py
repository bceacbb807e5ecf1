"""Buffers for the memory backend's values, ready before a put needs them.

A value the store has never held lands in fresh memory, and fresh memory
costs a page fault per 4 KiB while the bytes come in: on the H100's host a
cold store took saves at 1.5 GB/s where reused buffers took 10 GB/s
(docs/benchmarks.md). So the reserve keeps buffers of the size puts ask for
(a model's block value) already faulted in, up to `prefault_bytes`, filled
by threads of their own (FILL_THREADS: one faults in 1.5-3 GB/s, a burst of
saves asks for more), plus the buffers of values the store dropped (replaced
or evicted), up to `max_bytes` in all.

Buffers are anonymous memory maps: their pages are faulted by a memset that
runs without the GIL (ctypes), so filling the reserve, and filling a fresh
buffer from the socket or an engine's arena, never holds up the store's other
connections.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Optional

FILL_THREADS = 4


def fresh_buffer(size: int):
    """Zeroed memory of `size` bytes, its pages not yet faulted."""
    return bytearray(0) if size == 0 else mmap.mmap(-1, size)


def fault_in(buffer: mmap.mmap) -> None:
    """Touch every page now (zeroes: the buffer is fresh), without the GIL."""
    holder = ctypes.c_char.from_buffer(buffer)
    ctypes.memset(ctypes.addressof(holder), 0, len(buffer))
    del holder  # its export of the buffer ends here


class BufferReserve:
    """Invariant (under `_lock`): `_bytes` is the sum of the sizes of the
    buffers in `_free`, and `_bytes <= max_bytes`."""

    def __init__(self, max_bytes: int, prefault_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.prefault_bytes = min(prefault_bytes, max_bytes)
        self._free: dict[int, list[mmap.mmap]] = {}
        self._bytes = 0
        self._size: Optional[int] = None  # the size puts asked for last: the one to fault in ahead
        self._closed = False
        self._lock = threading.Condition()
        self._fillers: list[threading.Thread] = []
        self._filling = 0  # bytes the fillers are faulting in now (counted against prefault_bytes)

    def take(self, size: int):
        """A buffer of `size` bytes: a ready one, else a fresh one."""
        with self._lock:
            self._size = size
            spare = self._free.get(size)
            buffer = spare.pop() if spare else None
            if buffer is not None:
                self._bytes -= size
            if self.prefault_bytes > 0 and not self._fillers:
                self._fillers = [threading.Thread(target=self._fill, name=f"kvstore-reserve-{i}", daemon=True)
                                 for i in range(FILL_THREADS)]
                for filler in self._fillers:
                    filler.start()
            self._lock.notify_all()
        return buffer if buffer is not None else fresh_buffer(size)

    def give(self, buffer) -> bool:
        """Keep a buffer nobody refers to any more, if there is room (False: there is none)."""
        with self._lock:
            if self._bytes + len(buffer) > self.max_bytes:
                return False
            self._free.setdefault(len(buffer), []).append(buffer)
            self._bytes += len(buffer)
            return True

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()
            self._bytes = 0
            self._lock.notify_all()

    def _fill(self) -> None:
        def wanted() -> bool:
            return self._closed or self._bytes + self._filling + self._size <= self.prefault_bytes
        while True:
            with self._lock:
                self._lock.wait_for(wanted)
                if self._closed:
                    return
                size = self._size
                self._filling += size
            buffer = fresh_buffer(size)
            fault_in(buffer)
            with self._lock:  # one step: another filler must not count this buffer as missing
                self._filling -= size
                if self._bytes + size <= self.max_bytes:  # no room only if dropped buffers filled it meanwhile
                    self._free.setdefault(size, []).append(buffer)
                    self._bytes += size
