"""Each row's argmax of a batch of logits, quick at small batch on a GPU.

torch's argmax reduces a row within one block of threads: for one row of
Llama-3's 128,256 logits it took 36 us on an H200 (2026-11-29, `bench latency
--kernel-profile`), 0.8% of a batch-1 decode step, while reading the row
takes about 0.1 us. Split into chunks first, each row's chunks are reduced by
as many blocks at once: the largest value of each chunk, then the first chunk
holding the largest of those, then that chunk's index.

The result is argmax's exactly: torch.max(dim) and argmax both return the
first of equal largest values (a NaN counts as largest, as in argmax), so the
first chunk holding the row's largest value holds its first index.
"""
from __future__ import annotations

import functools

import torch

# Up to this many rows a batch takes the chunked path: 26.4 -> 10.0 us at 1
# row and 26.6 -> 12.6 us at 8 (H200, 128,256 bf16 logits, in a CUDA graph),
# but 27.3 -> 28.7 us at 64, where rows enough fill the GPU one block each.
MAX_CHUNKED_ROWS = 8
# The chunk length: the smallest divisor of the vocabulary between these (no
# padding copy): 256 for Llama-3's 128,256 and SmolLM2's 49,152, 1,187 for
# Qwen's 151,936.
MIN_CHUNK, MAX_CHUNK = 256, 2048


@functools.lru_cache(maxsize=None)
def chunk_length(vocab: int) -> int:
    """The smallest divisor of vocab in [MIN_CHUNK, MAX_CHUNK], 0 if none."""
    return next((n for n in range(MIN_CHUNK, min(MAX_CHUNK, vocab) + 1) if vocab % n == 0), 0)


def chunked_argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """argmax(dim=-1) of a [rows, vocab] tensor whose vocab chunk divides,
    in three reductions over [rows, vocab / chunk, chunk]."""
    rows, vocab = logits.shape
    best_in_chunk, where_in_chunk = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)
    best_chunk = best_in_chunk.argmax(dim=-1, keepdim=True)
    return (best_chunk * chunk + where_in_chunk.gather(1, best_chunk)).squeeze(1)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab] logits, chunked on a GPU at
    small batch (module docstring)."""
    rows, vocab = logits.shape
    chunk = chunk_length(vocab) if logits.is_cuda and rows <= MAX_CHUNKED_ROWS else 0
    if chunk == 0 or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    return chunked_argmax(logits, chunk)


__all__ = ["chunk_length", "chunked_argmax", "row_argmax"]
