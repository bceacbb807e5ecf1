"""KV blocks as bytes: what encode_block writes, decode_blocks_into reads back
bit for bit (bf16 included), and a block of another dtype, shape or layer is
refused, never misread."""
from __future__ import annotations

import pytest
import torch

from tandem.engine.connector.serialization import BlockFormatError, decode_blocks_into, encode_block

SHAPE = (2, 16, 3, 8)  # K and V, block size, KV heads, head dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_round_trip_bit_for_bit(dtype):
    blocks = torch.randn(5, *SHAPE).to(dtype)
    payloads = [encode_block(b, layer=7) for b in blocks]
    out = torch.empty(5, *SHAPE, dtype=dtype)
    decode_blocks_into(payloads, out, expect_layer=7)
    assert torch.equal(out.view(torch.uint8), blocks.view(torch.uint8))


@pytest.mark.parametrize("dtype, shape, layer", [
    (torch.float16, SHAPE, 7),  # another dtype
    (torch.float32, (2, 32, 3, 8), 7),  # another block size
    (torch.float32, SHAPE, 6),  # another layer
])
def test_a_foreign_block_is_refused(dtype, shape, layer):
    payload = encode_block(torch.randn(*shape).to(dtype), layer=layer)
    with pytest.raises(BlockFormatError):
        decode_blocks_into([payload], torch.empty(1, *SHAPE, dtype=torch.float32), expect_layer=7)


def test_a_truncated_block_is_refused():
    payload = encode_block(torch.randn(*SHAPE), layer=0)
    with pytest.raises(BlockFormatError):
        decode_blocks_into([payload[:-4]], torch.empty(1, *SHAPE), expect_layer=0)
    with pytest.raises(BlockFormatError):
        decode_blocks_into([b"nope" + payload[4:]], torch.empty(1, *SHAPE), expect_layer=0)
