"""A KV block as bytes: one value holds the block's every layer.

A fixed header of HEADER_BYTES, then the raw tensor [layers, 2 (K, V),
block_size, kv_heads, head_dim]. Header (little endian): magic "TKB1", the
dtype code (u8), three zero bytes, the five dimensions (u32 each), zeros to
HEADER_BYTES (which keeps the data aligned for every dtype). A block written
by an engine of another model shape, block size or dtype fails the check and
is recomputed, never misread.
"""
from __future__ import annotations

import struct

import torch

MAGIC = b"TKB1"
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sB3x5I")
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float8_e4m3fn: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class BlockFormatError(ValueError):
    pass


def block_header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The header of a block of `dtype` and `shape` ([layers, 2, block_size, kv_heads, head_dim])."""
    if len(shape) != 5:
        raise ValueError(f"a block is [layers, 2, block_size, kv_heads, head_dim], got {shape}")
    return _HEADER.pack(MAGIC, DTYPE_CODES[dtype], *shape).ljust(HEADER_BYTES, b"\0")


def check_block_header(raw, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise BlockFormatError unless `raw` (the value's first HEADER_BYTES) names this dtype and shape."""
    magic, code, *dims = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BlockFormatError("not a tandem KV block")
    if CODE_DTYPES.get(code) != dtype or tuple(dims) != tuple(shape):
        raise BlockFormatError(f"block is {CODE_DTYPES.get(code)} {tuple(dims)}; expected {dtype} {tuple(shape)}")
