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
from typing import Optional

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

    def span(self, offset: int, length: int) -> memoryview:
        """The arena's bytes [offset, offset + length), checked against its size."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"bytes {offset}..{offset + length} are outside the {self.size}-byte arena")
        return self.view[offset:offset + length]

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
            self._map.close()


def copy(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, without the GIL: ctypes calls release it, so copies of
    several connections (and the engine's own threads) run on several cores."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    if not len(src):
        return
    try:
        source = _address(src)
    except TypeError:  # read-only bytes (a value Redis returned): copied with the GIL
        dst[:] = src
        return
    ctypes.memmove(_address(dst), source, len(src))


def _address(view) -> int:
    """Where a writable buffer's bytes start (TypeError for a read-only one)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


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
