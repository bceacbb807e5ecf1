"""The rotary embedding of q and k and the KV cache write in one launch.

Attention's inputs took two kernels a layer: the rotary embedding (q and k
in place) and the scatter of k and v into the paged cache, which read back
the k the first had just written. At decode batch sizes each kernel is a
few microseconds of launch and memory round trip, so here one program per
token rotates its q and k heads, stores them back, and stores the rotated k
(from its registers) and v at the token's slot.

Twins: layer_ops_torch.rotary_torch, then paged_attention_torch.write_kv_torch.
It gives the same bits as the two launches it replaces (rotary_triton, then
write_kv_triton: the rotary's rounding points; the write's FP8 conversion,
divided by the scale correctly rounded, clamped to +-448, rounded to
nearest), which selfcheck.fused_write_mismatch checks; those two are
checked against the twins.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import pdl_launch, pdl_prologue
from tandem.kernels.cache_write import as_cached, cache_offset, cache_strides
from tandem.kernels.kv_cache_dtype import is_fp8
from tandem.kernels.layer_ops_triton import cos_sin_halves, rotate_heads

@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cs_tok,
    stride_cache_block, stride_cache_slot, stride_cache_head, k_scale, v_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr + tok * stride_cs_tok, sin_ptr + tok * stride_cs_tok, d, dmask, HALF)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dd = d[None, :]
    q_mask = (heads < NUM_Q_HEADS) & dmask[None, :]
    k_mask = (heads < NUM_K_HEADS) & dmask[None, :]
    rotate_heads(q_ptr + tok * stride_q_tok + heads * stride_q_head + dd, q_mask, c1, c2, s1, s2, HALF)
    k1, k2 = rotate_heads(k_ptr + tok * stride_k_tok + heads * stride_k_head + dd, k_mask, c1, c2, s1, s2, HALF)
    if slot >= 0:  # a padding token (slot -1) writes no KV
        dst = cache_offset(slot, stride_cache_block, stride_cache_slot, BLOCK_SIZE) + heads * stride_cache_head + dd
        cache_dtype = key_cache_ptr.dtype.element_ty
        tl.store(key_cache_ptr + dst, as_cached(k1, k_scale, cache_dtype, FP8, SCALED), mask=k_mask)
        tl.store(key_cache_ptr + dst + HALF, as_cached(k2, k_scale, cache_dtype, FP8, SCALED), mask=k_mask)
        v_row = v_ptr + tok * stride_v_tok + heads * stride_v_head + dd
        v1 = tl.load(v_row, mask=k_mask)
        v2 = tl.load(v_row + HALF, mask=k_mask)
        tl.store(value_cache_ptr + dst, as_cached(v1, v_scale, cache_dtype, FP8, SCALED), mask=k_mask)
        tl.store(value_cache_ptr + dst + HALF, as_cached(v2, v_scale, cache_dtype, FP8, SCALED), mask=k_mask)


def rotary_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (views of a fused QKV
    output are fine; cos/sin [T, D] in q's dtype), then store k and v
    [T, Hk, D] at their slots of kv_cache [2, num_blocks, block_size, Hk, D],
    its blocks in either layout (cache_write.cache_strides; an FP8 cache:
    divided by k_scale / v_scale). Returns (q, k)."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"rotary_write_kv_triton: {name} must have a dense last dimension")
    if head_dim % 2 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError("rotary_write_kv_triton: cos/sin must be [T, D] with an even D")
    if v.shape != k.shape or kv_cache.shape[-2:] != (num_k, head_dim):
        raise ValueError(f"rotary_write_kv_triton: v {tuple(v.shape)} and the cache's heads "
                         f"{tuple(kv_cache.shape[-2:])} must match k {tuple(k.shape)}")
    if tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_write_kv_kernel[(tokens,)](
        q, k, v, cos, sin, kv_cache[0], kv_cache[1], slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        *cache_strides(kv_cache), float(k_scale), float(v_scale),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=num_k, HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(max(num_q, num_k)), BLOCK_SIZE=kv_cache.shape[2],
        FP8=is_fp8(kv_cache.dtype),
        SCALED=k_scale != 1.0 or v_scale != 1.0, **pdl_launch(q))
    return q, k
