"""The FP8 linear layer on CUDA: a Triton kernel quantizes the activations
per token; torch._scaled_mm (the FP8 GEMM of cuBLASLt/CUTLASS, Hopper and
Ada) multiplies them by the e4m3 weight with row-wise scales (the token's
scale on A's rows, the channel's on B's columns), accumulated in fp32,
written in bf16. For one row (decode of one sequence) the GEMV of
gemv_triton.py multiplies the row, left in the model dtype, by the e4m3
weight on the CUDA cores (the twin's weight-only rule,
fp8_torch.WEIGHT_ONLY_MAX_ROWS: no quantizer launch). A Triton kernel on
the FP8 tensor cores (the "skinny" GEMM, tiles of 16-64 rows and 32-64
channels) takes a few rows (up to SKINNY_MAX_ROWS), where the FP8 GEMM's
tall tiles leave most multiprocessors idle, and the widths the FP8 GEMM
refuses (not multiples of 16).

Why a kernel for the quantization: as torch expressions it is five launches
(abs, amax, divide, clamp, cast) per linear layer, four layers a block; at
batch 1 those launches would cost as much as the bandwidth FP8 saves. Here it
is one launch that reads each row twice (its amax, then its quantized values).

Twin: fp8_torch.py (same scales, same clamping; e4m3 rounding is
round-to-nearest-even in both).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import interpreted, pdl_launch, pdl_prologue
from tandem.kernels.fp8_torch import FP8_DTYPE, FP8_MAX, INV_FP8_MAX, MIN_SCALE, WEIGHT_ONLY_MAX_ROWS
from tandem.kernels.gemv_triton import gemv

# Steps of up to this many rows (and more than WEIGHT_ONLY_MAX_ROWS) take the
# skinny Triton GEMM rather than the FP8 GEMM (module docstring).
SKINNY_MAX_ROWS = 64


@triton.jit
def _to_e4m3(v, q_dtype, ROUND_BY_HAND: tl.constexpr):
    """fp32 v, already within e4m3's range, rounded to the nearest e4m3 value
    (ties to even), as torch's cast does.

    ROUND_BY_HAND (Triton's CPU interpreter, whose fp32 -> e4m3 cast is wrong
    when rounding carries into the next power of two: 125.1 becomes 64):
    round on e4m3's grid in fp32 first, so the cast meets exact values only.
    The grid's step at |v| is 2^(exponent - 3), 2^-9 among the subnormals;
    adding and taking away 1.5 * 2^23 rounds v / step (under 16) to an
    integer, ties to even. The GPU's cast does this itself."""
    if ROUND_BY_HAND:
        exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
        step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
        v = ((v * inv_step + 12582912.0) - 12582912.0) * step
    return v.to(q_dtype)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols, fp8_max, inv_fp8_max, min_scale,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if ONE_PASS:  # the whole row in registers: read once
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
        q = _to_e4m3(tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max), q_ptr.dtype.element_ty, ROUND_BY_HAND)
        tl.store(q_ptr + row * stride_q + cols, q, mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = _to_e4m3(tl.clamp(tl.div_rn(x, scale), -fp8_max, fp8_max), q_ptr.dtype.element_ty, ROUND_BY_HAND)
        tl.store(q_ptr + row * stride_q + cols, q, mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M, 1]) of x [M, K]; see quantize_rows_torch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        # At decode a row is the whole grid (one program): rows up to 16384
        # wide are read once, into the registers of up to 16 warps (a
        # 14336-wide row in 1024-wide steps, read twice, took 7 us on the H200).
        one_pass = k <= 16384
        block = triton.next_power_of_2(k) if one_pass else 4096
        warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
        _quantize_rows_kernel[(m,)](x, q, scale, x.stride(0), q.stride(0), k, FP8_MAX, INV_FP8_MAX, MIN_SCALE,
                                    BLOCK=block, ONE_PASS=one_pass, ROUND_BY_HAND=interpreted(), **pdl_launch(x),
                                    num_warps=warps)
    return q, scale


@triton.jit
def _fp8_skinny_gemm_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                            stride_q, stride_w, stride_out, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        # e4m3 times e4m3 on the FP8 tensor cores, summed in fp32
        a = tl.load(q_ptr + rows[:, None] * stride_q + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc += tl.dot(a, b)
    xs = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    out = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


# A block's shared memory on Hopper (H100, H200), and what the 64-channel
# tiles over 4 stages take: 3 stages in flight of a 64 x 512 e4m3 weight tile
# and the 16 x 512 rows (what Triton 3.6 asked for these shapes on the H200).
HOPPER_SHARED_MEMORY = 232448
_WIDE_TILE_SHARED = 3 * (64 + 16) * 512


def few_rows_tile(shared_memory: int) -> tuple[int, int]:
    """(BLOCK_N, stages) up to 16 rows on a device with this much shared
    memory a block (bytes): 64 channels over 4 stages (120 KiB) where it
    fits, as on Hopper; else 32 over 3 (48 KiB), as on Ada's 99 KiB."""
    return (64, 4) if shared_memory >= _WIDE_TILE_SHARED else (32, 3)


@functools.lru_cache(maxsize=None)
def _few_rows_tile(device: torch.device) -> tuple[int, int]:
    """few_rows_tile of device (the Hopper tile under Triton's interpreter),
    cached per device as attention_triton._num_sms is."""
    if device.type != "cuda":
        return few_rows_tile(HOPPER_SHARED_MEMORY)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return few_rows_tile(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def fp8_skinny_gemm(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: Optional[torch.Tensor], out_dtype: torch.dtype, block_n: Optional[int] = None,
                    block_k: Optional[int] = None, num_warps: int = 4,
                    num_stages: Optional[int] = None) -> torch.Tensor:
    """(q * x_scale) [M, K] times (weight * weight_scale) [N, K]^T (+ bias):
    the arithmetic of the FP8 GEMM, for a few rows and for widths the FP8
    GEMM refuses (not multiples of 16).

    Up to 16 rows a program reads 64 x 512 weight tiles over 4 stages on
    Hopper (few_rows_tile): the FP8 decode step of an 8B Llama on an H200
    at 2 / 4 / 8 / 16 rows took 3.51 / 3.56 / 3.66 / 3.91 ms against 3.50 /
    3.57 / 3.83 / 4.09 with 32 x 512 over 3, which had beaten 32 x 256 over 4
    (3.50 / 3.56 / 3.82 / 4.02 against 3.94 / 4.00 / 4.30 / 4.29), each pair
    in one lease (`bench latency --quantization fp8`, docs/benchmarks.md)."""
    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    if block_m <= 16:
        few_n, few_stages = _few_rows_tile(q.device)
        block_n, block_k, num_stages = block_n or few_n, block_k or 512, num_stages or few_stages
    else:
        block_n, block_k, num_stages = block_n or 64, block_k or 128, num_stages or 4
    _fp8_skinny_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        q, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
        q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **pdl_launch(q), num_warps=num_warps,
        num_stages=num_stages)
    return out


def fp8_linear_cuda(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, quantize=quantize_rows_triton,
                    skinny: Optional[bool] = None) -> torch.Tensor:
    """x [M, K] times the e4m3 weight [N, K] (row-major, so weight.t() is the
    column-major B cuBLASLt wants) with per-channel scales [N], in x's dtype,
    by the twin's rule: up to WEIGHT_ONLY_MAX_ROWS rows x unquantized
    (gemv_triton.gemv), above it quantized per token. quantize: the activation
    quantizer (the twin's under --attention-backend torch); skinny (tests
    and benchmarks): quantize whatever the rows, then the skinny Triton GEMM
    (True) or the FP8 GEMM (False); None: the layer's rule, the skinny GEMM
    up to SKINNY_MAX_ROWS rows and for the widths the FP8 GEMM refuses."""
    m, k = x.shape
    if m <= WEIGHT_ONLY_MAX_ROWS and skinny is None:
        return gemv(x, weight, bias, weight_scale)
    # The FP8 GEMM needs both widths in multiples of 16; the Triton kernel takes any.
    gemm_shapes = k % 16 == 0 and weight.shape[0] % 16 == 0
    use_triton = skinny if skinny is not None else (m <= SKINNY_MAX_ROWS or not gemm_shapes)
    q, x_scale = quantize(x)
    if use_triton:
        return fp8_skinny_gemm(q, x_scale, weight, weight_scale, bias, x.dtype)
    # Row-wise scaled FP8 GEMMs write bf16 only; an fp16 engine gets a cast.
    out = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out if out.dtype == x.dtype else out.to(x.dtype)
