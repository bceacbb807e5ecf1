"""KV blocks as bytes: a small fixed header, then the raw tensor.

Header (little endian): magic "TKV1", dtype code (u8), layer (u16), ndim (u8),
then ndim u32 dimensions. The payload is one block of one layer, shaped
[2, block_size, num_kv_heads, head_dim] (K then V).
"""
from __future__ import annotations

import struct

import numpy as np
import torch

MAGIC = b"TKV1"
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class BlockFormatError(ValueError):
    pass


def encode_block(block: torch.Tensor, layer: int) -> bytes:
    block = block.contiguous().cpu()
    header = MAGIC + struct.pack("<BHB", DTYPE_CODES[block.dtype], layer, block.dim())
    header += struct.pack(f"<{block.dim()}I", *block.shape)
    # bytes of the raw storage; a uint8 view works for every dtype, bf16 included
    return header + block.view(torch.uint8).numpy().tobytes()


def _checked_data_offset(payload: bytes, expect_dtype: torch.dtype, expect_shape: tuple[int, ...],
                         expect_layer: int) -> int:
    """Where the tensor bytes start, once the header says what was expected."""
    if payload[:4] != MAGIC:
        raise BlockFormatError("not a tandem KV block")
    code, layer, ndim = struct.unpack_from("<BHB", payload, 4)
    shape = struct.unpack_from(f"<{ndim}I", payload, 8)
    dtype = CODE_DTYPES.get(code)
    if dtype != expect_dtype or tuple(shape) != tuple(expect_shape) or layer != expect_layer:
        raise BlockFormatError(f"block is {dtype} {shape} layer {layer}; expected {expect_dtype} "
                               f"{expect_shape} layer {expect_layer}")
    return 8 + 4 * ndim


def decode_blocks_into(payloads: list[bytes], out: torch.Tensor, expect_layer: int) -> None:
    """Decode len(payloads) blocks of one layer into `out` ([n, *block shape], on
    the CPU), with one copy per block: straight from each payload's bytes into
    place, none through intermediate objects (a 2k-token prompt is ~100 MB)."""
    rows = out.view(torch.uint8).numpy().reshape(len(payloads), -1)
    for row, payload in zip(rows, payloads):
        start = _checked_data_offset(payload, out.dtype, tuple(out.shape[1:]), expect_layer)
        if len(payload) - start != row.size:
            raise BlockFormatError(f"block has {len(payload) - start} bytes of data; expected {row.size}")
        row[:] = np.frombuffer(payload, dtype=np.uint8, offset=start)
