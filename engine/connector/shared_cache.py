"""A KV cache another process on the same host can map.

The prefill role allocates its cache here; the decode role opens it and
copies a finished prompt's blocks straight out (connector/direct.py), so no
byte of KV passes through gRPC, a store or Python.

- CPU: the cache lives in a named POSIX shared-memory segment (/dev/shm).
- CUDA: the cache is an ordinary CUDA allocation exported with a CUDA IPC
  handle (the mechanism torch.multiprocessing uses), so the copy runs device
  to device.

Either way a second small segment holds one generation counter per block,
which the block pool bumps each time it hands the block to a new owner. A
reader compares the counters after its copy: a block reused in the meantime
is detected and recomputed, never read as someone else's KV.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Optional

import numpy as np
import torch

from tandem.engine.connector.base import dtype_name

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "tandem-kv-"  # every segment this module creates is named so
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CudaIpcHandle:
    """What torch's UntypedStorage._share_cuda_() returns, field by field."""

    device_uuid: str  # the GPU, so a reader with another device numbering finds it
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class KVExport:
    """Where a prefill engine's KV cache lives and how it is laid out."""

    shape: tuple[int, ...]  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    dtype: str
    generations_shm: str  # names the export: unique per process and cache
    data_shm: str = ""  # CPU caches
    cuda: Optional[CudaIpcHandle] = None  # CUDA caches

    @property
    def num_blocks(self) -> int:
        return self.shape[2]


_CREATED_HERE: set[str] = set()  # segments this process made (and its resource tracker unlinks)


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class ExportedKVCache:
    """The producer's side: the cache tensor plus its export description."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        base = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        num_blocks = shape[2]
        self._segments: list[SharedMemory] = []
        gen_shm = self._create(f"{base}-gen", 8 * num_blocks)
        self.generations = np.ndarray((num_blocks,), dtype=np.int64, buffer=gen_shm.buf)
        cuda = None
        data_name = ""
        if device.type == "cpu":
            nbytes = _nbytes(shape, dtype)
            _check_room(nbytes)
            data = self._create(f"{base}-data", nbytes)
            data_name = data.name
            # A fresh segment reads as zeros, like the torch.zeros cache it replaces.
            self.tensor = _tensor_over(data, shape, dtype)
        elif device.type == "cuda":
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
            index = self.tensor.device.index
            fields = self.tensor.untyped_storage()._share_cuda_()
            cuda = CudaIpcHandle(_gpu_uuid(index), *fields)
        else:
            raise ValueError(f"cannot share a KV cache on {device.type}")
        self.export = KVExport(shape=tuple(shape), dtype=dtype_name(dtype),
                               generations_shm=gen_shm.name, data_shm=data_name, cuda=cuda)

    def _create(self, name: str, size: int) -> SharedMemory:
        shm = SharedMemory(name=name, create=True, size=size)
        _CREATED_HERE.add(shm.name)
        self._segments.append(shm)
        return shm

    def close(self) -> None:
        """Remove the segments' names; mappings (ours, readers') stay valid until unmapped."""
        for shm in self._segments:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._segments.clear()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _tensor_over(shm: SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` whose storage is the segment itself (no copy)."""
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=_nbytes(shape, dtype)).view(dtype).view(shape)


def _check_room(nbytes: int) -> None:
    # Pages of a shared segment are only taken when written; a segment larger
    # than /dev/shm would fail later with SIGBUS, in the middle of a step.
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ValueError(f"the shared KV cache needs {nbytes / 2**30:.2f} GiB but /dev/shm has "
                         f"{free / 2**30:.2f} GiB free: lower --num-blocks or enlarge /dev/shm")


def _attach(name: str) -> SharedMemory:
    shm = SharedMemory(name=name, create=False)
    # Python < 3.13 registers attached segments with this process's resource
    # tracker, which would unlink the producer's segment when we exit.
    if name not in _CREATED_HERE:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    return shm


@dataclass
class OpenedKVCache:
    tensor: torch.Tensor  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    generations: np.ndarray
    segments: list[SharedMemory]  # the mappings, kept alive as long as the tensors


def open_export(export: KVExport) -> OpenedKVCache:
    """Map another process's exported cache; raises OSError/RuntimeError when
    it cannot be reached from here (another host, another /dev/shm, no GPU)."""
    dtype = DTYPES[export.dtype]
    gen_shm = _attach(export.generations_shm)
    generations = np.ndarray((export.num_blocks,), dtype=np.int64, buffer=gen_shm.buf)
    segments = [gen_shm]
    if export.cuda is None:
        data = _attach(export.data_shm)
        segments.append(data)
        if data.size < _nbytes(export.shape, dtype):
            raise RuntimeError(f"shared KV segment {export.data_shm} is smaller than its shape says")
        tensor = _tensor_over(data, export.shape, dtype)
    else:
        tensor = _open_cuda(export.cuda, export.shape, dtype)
    return OpenedKVCache(tensor, generations, segments)


def _open_cuda(h: CudaIpcHandle, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise RuntimeError("the prefill's KV cache is on a GPU and this process has none")
    index = next((i for i in range(torch.cuda.device_count()) if _gpu_uuid(i) == h.device_uuid), None)
    if index is None:
        raise RuntimeError(f"the prefill's GPU {h.device_uuid} is not visible here (CUDA_VISIBLE_DEVICES?)")
    torch.cuda._lazy_init()  # noqa: SLF001 (what torch.multiprocessing does before opening a handle)
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001
            index, h.handle, h.size_bytes, h.offset_bytes, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle, h.event_sync_required)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    stride = torch.empty(shape, device="meta").stride()
    return torch._utils._rebuild_tensor(typed, 0, shape, stride)  # noqa: SLF001
