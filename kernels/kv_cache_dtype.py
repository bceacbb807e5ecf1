"""The KV cache's storage dtype: the model's own, or FP8 (e4m3, `--kv-cache-dtype fp8`).

An FP8 cache holds keys and values as e4m3 divided by the layer's scale: the
checkpoint's k_scale and v_scale where it has them, else one, as vLLM does. A
value is rounded to the nearest e4m3 (3 mantissa bits) and clamped to +-448,
its largest finite value; attention multiplies the scales back (the keys'
into the softmax scale, the values' into the output). Attention
widens the stored values back, exactly, before its products (to fp16 beside
16-bit queries: common_triton.fp16_products), so only the cache's bytes
halve: a decode step reads half the KV of a bf16 cache, and the same memory
holds twice the blocks.
"""
from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite e4m3 (float8_e4m3fn) value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it. FP8 stores x / scale (a checkpoint's k_scale
    or v_scale; attention multiplies it back), saturating at +-448 rather than
    turning larger values into NaN, as the Triton write does (satfinite)."""
    if is_fp8(dtype):
        if scale == 1.0:
            x = x.float()
        else:
            # Divided as the Triton write divides (div_rn: fp32, correctly
            # rounded, by the fp32 scale it is given). Not x / scale: on an
            # H200 that stored 24 of 131,072 values other than the kernel's
            # (kernels.selfcheck, 2026-12-02; torch may divide by a scalar
            # through its reciprocal). The quotient in fp64 rounded to fp32
            # is the correctly rounded fp32 quotient (53 >= 2 x 24 + 2
            # bits), on every device.
            x = (x.double() / float(torch.tensor(scale, dtype=torch.float32))).float()
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def movable(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes where t is FP8: torch's CPU index_copy_ has no FP8
    kernel, and a copy of bytes is the same copy."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
