"""Triton kernels for the per-layer ops around attention: RMSNorm with the
residual add folded in, rotary embedding of q and k in one launch, and
SiLU-and-multiply.

Why: written as torch expressions these are 25-30 small kernels per layer
(an RMSNorm alone is eight: cast, square, mean, add, rsqrt, multiply, cast,
multiply). At decode batch sizes each costs a few microseconds of launch and
memory round trip even inside a CUDA graph, about as much in all as reading
the weights. Here they are four launches per layer.

Twins: layer_ops_torch.py. The kernels compute in fp32 and round to the
activation dtype at the points the twins (and HF transformers) round, so
they agree with the twins to within a rounding step of the summation order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import pdl_launch, pdl_prologue


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr,
                     stride_x_row, stride_x_head, stride_res_row, stride_out_row, stride_out_head,
                     num_heads, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    tok = (row // num_heads).to(tl.int64)
    head = (row % num_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + tok * stride_x_row + head * stride_x_head + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + tok * stride_res_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype).to(tl.float32)  # the residual add, rounded as a torch add would be
        tl.store(res_ptr + tok * stride_res_row + cols, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_out_row + head * stride_out_head + cols, (w * y).to(dtype), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [T, N] or [T, H, N] (per-head norms: Qwen3's q/k norms); residual
    [T, N], updated in place to x + residual. Returns (normed, residual)."""
    n = x.shape[-1]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm_triton: the last dimension must be dense")
    if residual is not None and (x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("rms_norm_triton: a residual must be [T, N] like x")
    heads = x.shape[1] if x.dim() == 3 else 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[0] * heads
    if rows == 0:
        return out, residual
    stride_head = x.stride(1) if x.dim() == 3 else 0
    out_head = out.stride(1) if x.dim() == 3 else 0
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, x.stride(0), stride_head, res.stride(0), out.stride(0), out_head,
        heads, n, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
        **pdl_launch(x))
    return out, residual


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr,
                   stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cs_tok,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr + tok * stride_cs_tok, sin_ptr + tok * stride_cs_tok, d, dmask, HALF)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dd = d[None, :]
    rotate_heads(q_ptr + tok * stride_q_tok + heads * stride_q_head + dd,
                 (heads < NUM_Q_HEADS) & dmask[None, :], c1, c2, s1, s2, HALF)
    rotate_heads(k_ptr + tok * stride_k_tok + heads * stride_k_head + dd,
                 (heads < NUM_K_HEADS) & dmask[None, :], c1, c2, s1, s2, HALF)


@triton.jit
def cos_sin_halves(cos_row, sin_row, d, dmask, HALF: tl.constexpr):
    """One token's cos and sin, each as its two halves [1, HALF_PAD] in fp32."""
    c1 = tl.load(cos_row + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def rotate_heads(first_half, mask, c1, c2, s1, s2, HALF: tl.constexpr):
    """Rotate one token's heads in place: first_half points at each head's
    first HALF elements [heads, HALF_PAD]. Returns the two rotated halves, in
    the tensor's dtype, as stored (rotary_kv_write_triton writes them on)."""
    dtype = first_half.dtype.element_ty
    x1 = tl.load(first_half, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_half + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch would
    o1 = ((x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first_half, o1, mask=mask)
    tl.store(first_half + HALF, o2, mask=mask)
    return o1, o2


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (views of a fused QKV
    output are fine); cos/sin [T, D] in q's dtype. Returns (q, k)."""
    tokens, num_q, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary_triton: the last dimensions must be dense")
    if head_dim % 2 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError("rotary_triton: cos/sin must be [T, D] with an even D")
    if tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=k.shape[1], HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(max(num_q, k.shape[1])), **pdl_launch(q))
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + tok * stride_out + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    tokens, width = gate_up.shape
    if gate_up.stride(-1) != 1 or width % 2:
        raise ValueError("silu_and_mul_triton: gate_up must be [T, 2I] with a dense last dimension")
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                          BLOCK=block, **pdl_launch(gate_up))
    return out
