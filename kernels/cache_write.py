"""Triton kernel that scatters new keys/values into the paged KV cache.

Twin: `write_kv_torch` in paged_attention_torch.py (same signature, same
result). One program per token copies all its KV heads for K and V; a slot
below zero marks a padding token whose K/V is not written. An FP8 cache
(kv_cache_dtype.py) gets the values divided by their scale, clamped to +-448
and rounded to nearest.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import pdl_launch, pdl_prologue
from tandem.kernels.kv_cache_dtype import FP8_E4M3_MAX, is_fp8

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)  # a jitted function reads constexpr globals only


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + src * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    dst = cache_offset(slot, stride_cache_block, stride_cache_slot, BLOCK_SIZE) + heads * stride_cache_head + dims
    cache_dtype = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + dst, as_cached(k, k_scale, cache_dtype, FP8, SCALED), mask=mask)
    tl.store(value_cache_ptr + dst, as_cached(v, v_scale, cache_dtype, FP8, SCALED), mask=mask)


@triton.jit
def cache_offset(slot, stride_cache_block, stride_cache_slot, BLOCK_SIZE: tl.constexpr):
    """Where a slot's row starts in a cache of any block layout (cache_strides):
    its block, then its place in the block. The slot (int64) of a large cache
    exceeds int32 once multiplied out."""
    return (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot


def cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot, head) strides of kv_cache [2, num_blocks, block_size,
    num_kv_heads, head_dim], whatever order its blocks keep in memory: the
    engine's tokens-outer blocks or heads-outer ones (--kv-cache-layout HND,
    a transposed view). The last dimension must be dense."""
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"the KV cache's head_dim must be dense (stride {kv_cache.stride(-1)})")
    return kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


@triton.jit
def as_cached(x, scale, cache_dtype, FP8: tl.constexpr, SCALED: tl.constexpr):
    """Values as the cache stores them: over FP8, divided by a checkpoint's
    scale correctly rounded (as the twin divides) and saturated at +-448 as
    the twin does, whatever the conversion does past it."""
    if FP8:
        x = x.to(tl.float32)
        if SCALED:
            x = tl.div_rn(x, scale)
        x = tl.clamp(x, -_FP8_MAX, _FP8_MAX)
    return x.to(cache_dtype)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots
    (an FP8 cache: divided by k_scale / v_scale).

    kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim], its
    blocks in either layout (cache_strides); the last dimension of key, value
    and cache must be dense (stride of head_dim 1), as it is for the views a
    fused QKV projection produces.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_head_dim(head_dim)
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1:
            raise ValueError(f"write_kv_triton: {name} must have a dense last dimension "
                             f"(stride {t.stride(2)}); pass .contiguous()")
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache_strides(kv_cache), float(k_scale), float(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=kv_cache.shape[2], FP8=is_fp8(kv_cache.dtype),
        SCALED=k_scale != 1.0 or v_scale != 1.0, **pdl_launch(key),
    )


def _check_head_dim(head_dim: int) -> None:
    # tl.arange needs a power of two; 16 is the smallest tl.dot operand size.
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"Triton paged attention needs a power-of-two head_dim >= 16, got "
                         f"{head_dim}; run this model with --attention-backend torch "
                         "(TANDEM_ATTENTION_BACKEND=torch)")
