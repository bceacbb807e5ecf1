"""The CPU engine's KV cache reads as zeros and takes resident memory only for
the blocks written, not for all of --cpu-kv-cache-gib at start."""
from __future__ import annotations

import torch

from tandem.engine.model_runner import zeroed_kv_cache
from tests.support.memory import resident_bytes

MIB = 2**20


def test_a_cpu_kv_cache_is_zero_and_resident_only_where_written():
    shape = (2, 4, 1024, 16, 64)  # (k/v, layers, blocks, tokens, head dim): 512 MiB of fp32
    before = resident_bytes()
    cache = zeroed_kv_cache(shape, torch.float32, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.float32 and cache.is_contiguous()
    cache[:, :, 7] = 1.0  # one block of every layer: 256 KiB
    assert resident_bytes() - before < 32 * MIB  # torch.zeros: all 512 MiB
    assert float(cache[:, :, 7].sum()) == cache[:, :, 7].numel()
    assert not cache[:, :, :7].any() and not cache[:, :, 8:16].any()


def test_a_bf16_cpu_kv_cache_has_its_shape_and_dtype():
    cache = zeroed_kv_cache((2, 1, 3, 16, 8), torch.bfloat16, torch.device("cpu"))
    assert cache.dtype == torch.bfloat16 and cache.shape == (2, 1, 3, 16, 8)
    cache[1, 0, 2, 15, 7] = 2.5
    assert float(cache.float().sum()) == 2.5
