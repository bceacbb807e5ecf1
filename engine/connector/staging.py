"""Where the store connector stages blocks: fixed-size slots, one block each
(its header, then every layer), over the bytes the KV store moves blocks
through (KVStore.open_arena). A step's saves are written into their slots
layer by layer as the model runs; a load is read from the store into slots
and copied into the cache from there. The memory is allocated once and
reused: no fresh buffers (and their page faults) per transfer.

Slots are handed out as contiguous runs, so a run is one strided tensor
[n, layers, 2, block_size, kv_heads, head_dim] and a layer of a whole step's
saves, or a whole load, is one copy.

For a CUDA cache the arena is pinned (page-locked with cudaHostRegister), so
copies between it and the GPU are DMA at the link's speed and can be queued
without waiting (non_blocking) instead of going through a pageable bounce
buffer while the engine thread waits.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from tandem.engine.connector.base import KVCacheLayout
from tandem.engine.connector.serialization import HEADER_BYTES, block_header, check_block_header

ALIGN = 64

log = logging.getLogger(__name__)


def pin_host_memory(buffer) -> int:
    """Page-lock a writable host buffer (bytes-like or a CPU tensor) for DMA
    (cudaHostRegister); returns CUDA's error code, 0 on success. Undo it with
    unpin_host_memory before the memory goes: a registration left behind
    refuses to pin a later mapping at the same address (CUDA error 712)."""
    held = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(buffer, dtype=torch.uint8)
    return int(torch.cuda.cudart().cudaHostRegister(held.data_ptr(), held.numel() * held.element_size(), 0))


def unpin_host_memory(buffer) -> None:
    held = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(buffer, dtype=torch.uint8)
    torch.cuda.cudart().cudaHostUnregister(held.data_ptr())


class StagingArena:
    def __init__(self, memory: memoryview, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.block_shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.data_bytes = layout.block_bytes
        self.slot_bytes = self.slot_size(layout)
        self.num_slots = len(memory) // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"a staging arena of {len(memory)} bytes holds no block of {self.slot_bytes} bytes")
        self.memory = memory
        raw = torch.frombuffer(memory, dtype=torch.uint8)[: self.num_slots * self.slot_bytes]
        raw = raw.view(self.num_slots, self.slot_bytes)
        self._headers = raw[:, :HEADER_BYTES]
        self.blocks = (raw[:, HEADER_BYTES:HEADER_BYTES + self.data_bytes].view(layout.dtype)
                       .view(self.num_slots, *self.block_shape))
        self._header = torch.frombuffer(bytearray(block_header(layout.dtype, self.block_shape)),
                                        dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, self.num_slots)]  # (start, length), sorted, merged
        self._lock = threading.Condition()
        self._raw = raw
        self.pinned = False

    def pin(self) -> bool:
        """Page-lock the arena for CUDA copies (once; False where CUDA refuses,
        e.g. a locked-memory limit: copies then work as before, only slower)."""
        if self.pinned:
            return True
        code = pin_host_memory(self._raw)
        if code != 0:
            log.warning("could not pin the %.0f MiB KV staging arena (CUDA error %s): its copies to and from "
                        "the GPU stay synchronous", self._raw.numel() / 2**20, code)
            return False
        self.pinned = True
        return True

    def unpin(self) -> None:
        """Undo pin(), before the memory goes (see unpin_host_memory)."""
        if self.pinned:
            self.pinned = False
            unpin_host_memory(self._raw)

    @staticmethod
    def slot_size(layout: KVCacheLayout) -> int:
        """Bytes of one slot: a block's header and data, rounded up to ALIGN."""
        return -(-(HEADER_BYTES + layout.block_bytes) // ALIGN) * ALIGN

    # ---- slots ---------------------------------------------------------
    def alloc(self, n: int, wait_s: float = 0.0, keep_free: int = 0) -> Optional[int]:
        """The first of n contiguous free slots, or None when there are none
        (after waiting up to wait_s for frees), or when taking them would leave
        fewer than keep_free slots free."""
        if n <= 0 or n > self.num_slots - keep_free:
            return None

        def room() -> bool:
            return self._num_free() - n >= keep_free and self._fits(n)
        with self._lock:
            if not room() and wait_s > 0:
                # Puts and loads under way give their slots back as they end.
                self._lock.wait_for(room, timeout=wait_s)
            return self._take(n) if room() else None

    def _num_free(self) -> int:
        return sum(length for _, length in self._free)

    def _fits(self, n: int) -> bool:
        return any(length >= n for _, length in self._free)

    def _take(self, n: int) -> Optional[int]:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                return start
        return None

    def free(self, start: int, n: int) -> None:
        with self._lock:
            self._free.append((start, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for s, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((s, length))
            self._free = merged
            self._lock.notify_all()

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._num_free()

    # ---- contents --------------------------------------------------------
    def write_headers(self, start: int, n: int) -> None:
        self._headers[start:start + n] = self._header

    def headers_ok(self, start: int, n: int) -> bool:
        """Whether slots start..start+n hold blocks of this layout (a block of
        another model, dtype or shape would be misread)."""
        try:
            for slot in range(start, start + n):
                offset = slot * self.slot_bytes
                check_block_header(self.memory[offset:offset + HEADER_BYTES], self.layout.dtype, self.block_shape)
        except ValueError:
            return False
        return True

    def items(self, keys: list[str], start: int) -> list[tuple[str, int, int]]:
        """(key, offset, length) of each slot from `start` on, for KVStore.put / get."""
        size = HEADER_BYTES + self.data_bytes
        return [(key, (start + i) * self.slot_bytes, size) for i, key in enumerate(keys)]
