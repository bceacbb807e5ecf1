"""An engine's KV staging arena in shared memory, and the KV store's view of it.

The engine (MovedBlockStoreClient) creates the segment; its mover process
maps it to move bytes over the data channel. When the KV store runs where it
can open the same segment (the same host and /dev/shm: `tandem up`, or a
store beside the engine in one pod), the store maps it too, and a block's
bytes go from the arena straight into the store's value and back, one memory
copy each way, with no socket in between (data_wire's *_SHARED operations).

A store may see a different /dev/shm with a segment of the same name (another
pod on the node). So the segment ends with a random token after the arena:
the store attaches only when the token it reads is the one the client sent.
The store opens only segments named with SEGMENT_PREFIX, and checks every
offset it is given against the arena's size.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from multiprocessing.shared_memory import SharedMemory
from typing import Optional, Sequence

SEGMENT_PREFIX = "tandem-kvarena-"
TOKEN_BYTES = 16
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (SharedMemory's segments)


class SharedArena:
    """A new segment of `nbytes` (plus the token); `view` is the arena."""

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.token = secrets.token_bytes(TOKEN_BYTES)
        # Created through SharedMemory, so Python's resource tracker removes it
        # if this process dies without close(); mapped here as a plain file,
        # so that tensors over the arena keep the mapping alive on their own.
        segment = SharedMemory(name=f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}",
                               create=True, size=nbytes + TOKEN_BYTES)
        segment.close()
        self._segment = segment
        self.name = segment.name
        try:
            _check_room(nbytes + TOKEN_BYTES)
            self._map = _map(self.name, nbytes + TOKEN_BYTES)
        except (OSError, ValueError):
            segment.unlink()
            raise
        self._map[nbytes:nbytes + TOKEN_BYTES] = self.token
        self.view: Optional[memoryview] = memoryview(self._map)[:nbytes]

    def close(self) -> None:
        """Remove the segment's name (its creator's job). The mapping is left to
        the garbage collector: tensors over the arena may outlive this call,
        and unmapping under them would crash the process."""
        if self.view is not None:
            self.view = None
            self._segment.unlink()


class AttachedArena:
    """Another process's SharedArena, opened by name; raises ValueError when
    it is not there, not ours, or not the one the token names."""

    def __init__(self, name: str, token: bytes, size: int) -> None:
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise ValueError(f"{name!r} is not a tandem KV arena")
        # Mapped as the file it is, not through SharedMemory: that would enlist
        # the segment with Python's resource tracker, which unlinks it when this
        # process exits (only its creator may).
        try:
            self._map = _map(name, size + TOKEN_BYTES)
        except OSError as exc:
            raise ValueError(f"no shared-memory segment {name!r} here: {exc.strerror}") from None
        except ValueError:
            raise ValueError(f"segment {name!r} here is smaller than the client's arena (another /dev/shm)") from None
        if self._map[size:size + TOKEN_BYTES] != token:
            self._map.close()
            raise ValueError(f"segment {name!r} here is not the client's (another /dev/shm)")
        self.name, self.token, self.size = name, token, size
        self.view: Optional[memoryview] = memoryview(self._map)[:size]
        self._base_export = ctypes.c_char.from_buffer(self._map)  # released in close()
        self._base = ctypes.addressof(self._base_export)

    def populate_if_resident(self) -> bool:
        """Map every page of the arena into this process now, when the client
        already holds them all (a CUDA engine pins its arena): each copy would
        otherwise take a page fault per 4 KiB the first time it touches a page
        through this mapping (about 2 million in a sweep of the H200 serving
        benchmark). An arena only partly touched (a CPU engine's) is left to
        fault in as used: populating would allocate all of it. Runs without
        the GIL; True if it populated."""
        if not self.size or _resident_fraction(self._base, self.size) < 0.99:
            return False
        return _libc.madvise(self._base & ~(PAGE - 1), self.size, MADV_POPULATE_WRITE) == 0

    def check(self, spans: Sequence[tuple[int, int]]) -> None:
        """ValueError unless every (offset, length) lies inside the arena."""
        for offset, length in spans:
            if offset < 0 or length < 0 or offset + length > self.size:
                raise ValueError(f"bytes {offset}..{offset + length} are outside the {self.size}-byte arena")

    def read_into(self, buffers: Sequence, spans: Sequence[tuple[int, int]]) -> None:
        """buffers[i][:] = the arena's span i (spans checked, each buffer as
        long as its span, writable): one memmove each, without the GIL."""
        for buffer, (offset, length) in zip(buffers, spans):
            if len(buffer) != length:
                raise ValueError(f"a {len(buffer)}-byte buffer for a {length}-byte span")
            if length:
                ctypes.memmove(_address(buffer), self._base + offset, length)

    def write_from(self, buffers: Sequence, spans: Sequence[tuple[int, int]]) -> None:
        """The arena's span i = buffers[i]: one memmove each, without the GIL
        (bytes too; another read-only buffer is copied with it held)."""
        for buffer, (offset, length) in zip(buffers, spans):
            if len(buffer) != length:
                raise ValueError(f"a {len(buffer)}-byte value for a {length}-byte span")
            if not length:
                continue
            if isinstance(buffer, bytes):
                ctypes.memmove(self._base + offset, buffer, length)
                continue
            try:
                source = _address(buffer)
            except TypeError:  # a read-only view
                self.view[offset:offset + length] = buffer
                continue
            ctypes.memmove(self._base + offset, source, length)

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
            del self._base_export
            self._map.close()


PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+ (Python names it only from 3.13 on)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _resident_fraction(address: int, nbytes: int) -> float:
    """The fraction of the pages of [address, address + nbytes) in memory
    (mincore: for a shared file mapping, whether each page is in the page
    cache, mapped here or not); 0.0 where mincore fails."""
    start = address & ~(PAGE - 1)
    pages = (address + nbytes - start + PAGE - 1) // PAGE
    vector = (ctypes.c_ubyte * pages)()
    if _libc.mincore(start, pages * PAGE, vector) != 0:
        return 0.0
    return sum(b & 1 for b in bytes(vector)) / pages


def _address(buffer) -> int:
    """Where a writable buffer's bytes start (TypeError for a read-only one)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _map(name: str, nbytes: int) -> mmap.mmap:
    """The first nbytes of /dev/shm/<name>, shared and writable (ValueError: smaller)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(name)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _check_room(nbytes: int) -> None:
    # Pages of a segment are only taken when written: a segment larger than
    # /dev/shm fails later with SIGBUS, in the middle of a transfer.
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ValueError(f"/dev/shm has {free / 2**20:.0f} MiB free")
