"""A prefill's handle to a prompt's blocks between its engine form (in
RequestOutput.kv_transfer_params: a DirectHandle, or a NixlHandle) and its
wire form (common.proto KVHandle); and the store path's note of the blocks a
prefill is still writing (KVStoreWrite)."""
from __future__ import annotations

from typing import Optional

from tandem.engine.connector import nixl
from tandem.engine.connector.kvstore import WRITE_KEY
from tandem.engine.connector.direct import HANDLE_KEY, DirectHandle
from tandem.engine.connector.shared_cache import SEGMENT_PREFIX, CudaIpcHandle, KVExport
from tandem.v1 import common_pb2

DTYPES = ("bfloat16", "float16", "float32")


def handle_to_proto(kv_transfer_params: dict) -> Optional[common_pb2.KVHandle]:
    nixl_handle: Optional[nixl.NixlHandle] = kv_transfer_params.get(nixl.HANDLE_KEY)
    if nixl_handle is not None:
        return _nixl_to_proto(nixl_handle)
    handle: Optional[DirectHandle] = kv_transfer_params.get(HANDLE_KEY)
    if handle is None:
        return None
    e = handle.export
    msg = common_pb2.KVHandle(shape=list(e.shape), dtype=e.dtype, generations_shm=e.generations_shm,
                              data_shm=e.data_shm, model=handle.model, block_ids=handle.block_ids,
                              generations=handle.generations)
    if e.cuda is not None:
        msg.cuda.CopyFrom(_cuda_to_proto(e.cuda))
    for r in handle.rank_exports:
        rank = msg.rank_caches.add(generations_shm=r.generations_shm, data_shm=r.data_shm)
        if r.cuda is not None:
            rank.cuda.CopyFrom(_cuda_to_proto(r.cuda))
    return msg


def _cuda_to_proto(c: CudaIpcHandle) -> common_pb2.CudaIpcHandle:
    return common_pb2.CudaIpcHandle(
        device_uuid=c.device_uuid, device=c.device, handle=c.handle, size_bytes=c.size_bytes,
        offset_bytes=c.offset_bytes, ref_counter_handle=c.ref_counter_handle,
        ref_counter_offset=c.ref_counter_offset, event_handle=c.event_handle,
        event_sync_required=c.event_sync_required)


def _export_from_proto(shape: tuple[int, ...], dtype: str, cache) -> KVExport:
    """A KVHandle's or KVRankCache's cache; only segments a tandem prefill
    made: a handle must not open other shared memory."""
    for name in (cache.generations_shm, cache.data_shm):
        if name and not name.startswith(SEGMENT_PREFIX):
            raise ValueError(f"kv_handle: {name!r} is not a tandem KV segment")
    cuda = None
    if cache.HasField("cuda"):
        c = cache.cuda
        cuda = CudaIpcHandle(c.device_uuid, c.device, c.handle, c.size_bytes, c.offset_bytes,
                             c.ref_counter_handle, c.ref_counter_offset, c.event_handle,
                             c.event_sync_required)
    elif not cache.data_shm:
        raise ValueError("kv_handle: names neither a shared-memory segment nor a CUDA handle")
    return KVExport(shape=shape, dtype=dtype, generations_shm=cache.generations_shm, data_shm=cache.data_shm,
                    cuda=cuda)


def _nixl_to_proto(h: "nixl.NixlHandle") -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        shape=list(h.shape), dtype=h.dtype, model=h.model, block_ids=h.block_ids, generations=h.generations,
        nixl=common_pb2.NixlExport(agent=h.agent, metadata=h.metadata, mem_type=h.mem_type, device=h.device,
                                   cache_address=h.cache_address, generations_address=h.generations_address))


def handle_from_proto(msg: common_pb2.KVHandle) -> dict:
    """kv_transfer_params for the engine; raises ValueError on a malformed handle."""
    if len(msg.shape) != 6 or len(msg.block_ids) != len(msg.generations):
        raise ValueError("kv_handle: shape must have 6 dimensions and every block a generation")
    if msg.dtype not in DTYPES:
        raise ValueError(f"kv_handle: unknown dtype {msg.dtype!r}")
    if any(b < 0 or b >= msg.shape[2] for b in msg.block_ids):
        raise ValueError("kv_handle: block ids outside the cache")
    if msg.HasField("nixl"):
        n = msg.nixl
        if not n.agent or not n.metadata or n.mem_type not in ("DRAM", "VRAM"):
            raise ValueError("kv_handle.nixl: needs an agent, its metadata and a memory type (DRAM or VRAM)")
        # The addresses are the producer's: NIXL reads only inside memory that agent registered.
        return {nixl.HANDLE_KEY: nixl.NixlHandle(
            agent=n.agent, metadata=n.metadata, model=msg.model, shape=tuple(msg.shape), dtype=msg.dtype,
            mem_type=n.mem_type, device=n.device, cache_address=n.cache_address,
            generations_address=n.generations_address, block_ids=list(msg.block_ids),
            generations=list(msg.generations))}
    shape = tuple(msg.shape)
    export = _export_from_proto(shape, msg.dtype, msg)
    ranks = tuple(_export_from_proto(shape, msg.dtype, r) for r in msg.rank_caches)
    return {HANDLE_KEY: DirectHandle(export, msg.model, list(msg.block_ids), list(msg.generations), ranks)}


def store_write_to_proto(kv_transfer_params: dict) -> Optional[common_pb2.KVStoreWrite]:
    write = kv_transfer_params.get(WRITE_KEY)
    if not write:
        return None
    first, count = write
    return common_pb2.KVStoreWrite(first_block=first, num_blocks=count)


def store_write_from_proto(msg: common_pb2.KVStoreWrite, num_prompt_tokens: int) -> dict:
    """kv_transfer_params for the engine; raises ValueError for blocks the
    prompt does not have (a decode would wait for keys that never come)."""
    # Block counts are checked against the smallest block size an engine takes
    # (the decode's own, which this layer does not know, is at least 1 token).
    if msg.first_block < 0 or msg.num_blocks < 0 or msg.first_block + msg.num_blocks > num_prompt_tokens:
        raise ValueError(f"kv_store_write: blocks {msg.first_block}..{msg.first_block + msg.num_blocks} "
                         f"are not blocks of a {num_prompt_tokens}-token prompt")
    return {WRITE_KEY: (msg.first_block, msg.num_blocks)} if msg.num_blocks else {}
