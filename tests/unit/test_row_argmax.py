"""engine/row_argmax.py: the chunked argmax a small GPU batch takes is torch's
argmax exactly, equal largest values, NaN and rows of -inf included."""
from __future__ import annotations

import pytest
import torch

from tandem.engine.row_argmax import MAX_CHUNKED_ROWS, chunk_length, chunked_argmax, row_argmax


def test_chunks_divide_the_vocabularies_of_the_presets():
    assert chunk_length(128_256) == 256  # Llama-3
    assert chunk_length(151_936) == 1187  # Qwen2/3
    assert chunk_length(49_152) == 256  # SmolLM2
    assert chunk_length(32_003) == 0  # prime beyond 2,048: argmax as it is
    assert chunk_length(300) == 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_is_argmax(dtype):
    torch.manual_seed(0)
    vocab, chunk = 4096, 256
    logits = torch.randn(9, vocab).to(dtype)
    logits[1, 700] = logits[1, 3000] = 50  # ties across chunks: the first
    logits[2, 300] = logits[2, 301] = 50  # ties within a chunk: the first
    logits[3, 2000] = float("nan")  # NaN counts as the largest, as in argmax
    logits[3, 2500] = float("nan")
    logits[4] = float("-inf")  # nothing allowed: index 0, as argmax gives
    logits[5, :] = 7.0  # all equal
    logits[6, vocab - 1] = 60  # the last element
    expected = logits.argmax(dim=-1)
    assert torch.equal(chunked_argmax(logits, chunk), expected)
    assert expected[1] == 700 and expected[2] == 300 and expected[3] == 2000 and expected[4] == 0
    assert torch.equal(row_argmax(logits), expected)  # on the CPU: argmax itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chunked path runs on CUDA")
def test_row_argmax_on_cuda_takes_the_chunks_and_matches():
    torch.manual_seed(1)
    logits = torch.randn(MAX_CHUNKED_ROWS, 128_256, device="cuda", dtype=torch.bfloat16)
    logits[0, 5] = logits[0, 100_000] = 99
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
