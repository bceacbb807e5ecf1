"""One row of activations times a weight matrix, on the CUDA cores: the
linear layers of a decode step of one sequence, for 16-bit weights and for
e4m3 weights with per-channel scales (weight-only: the row stays in the
model dtype, fp8_torch.WEIGHT_ONLY_MAX_ROWS). Two rows of large 16-bit
weights on the CUDA cores, each weight tile read once for both: gemv_pair.
And a few rows (up to 16) at once on the tensor cores, 16-bit weights:
gemv_rows, below.

A step of one row reads every weight once and multiplies it once: there is
no tile to reuse, so the work is streaming the weight through the
multiprocessors as fast as memory allows. cuBLAS splits such products over
K and adds a reduction launch; here each program streams BLOCK_N whole
weight rows with its own prefetch pipeline, and the row of x comes from L2.
On an H200 this made the bf16 batch-1 decode step of an 8B Llama 4.71 ->
4.28 ms (docs/benchmarks.md, the twenty-first session).

Twins: torch.nn.functional.linear (16-bit weights) and
fp8_torch.fp8_linear_torch(..., weight_only=True) (e4m3 weights).
gemv_pair's and gemv_rows' twin is torch.nn.functional.linear.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import dot_settings, mma, pdl_launch, pdl_prologue

# CUDA bounds a grid's second dimension (the channel tiles here) to 65535
# programs: wider products (a vocabulary over 524,280 at 8-channel tiles)
# launch once per slice of channels.
MAX_CHANNEL_TILES = 65535


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, N, K, stride_x, stride_w, stride_out,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, PDL: tl.constexpr):
    """Products in fp32 (e4m3 and 16-bit values widen exactly), each program
    summing BLOCK_N output channels of one row of x.

    The loop is pipelined explicitly (tl.range's num_stages): Triton's
    kernel-wide num_stages pipelines loops that feed tl.dot, not this one,
    which then waited for each tile before asking for the next (H200, one
    lease: an 8B Llama's four projections at one row in FP8 73.5 -> 64.3 us).

    The first weight tile is asked for before the wait for the kernel
    before (pdl_prologue): no kernel of a step writes weights, so the stream
    starts while that kernel finishes; x, its output, is read after the wait
    (H200, one lease: the bf16 batch-1 step of an 8B Llama 4.24 -> 4.17 ms)."""
    # Rows vary fastest over the grid: the programs of one weight tile run
    # side by side, and all but the first read it from L2.
    row = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    ks = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
    pdl_prologue(PDL)
    x_row = x_ptr + row * stride_x
    x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    acc = w_first.to(tl.float32) * x[None, :]
    for start in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += w * x[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out *= tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         weight_scale: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
         block_n: int = 8, block_k: Optional[int] = None, num_warps: int = 4,
         num_stages: Optional[int] = None) -> torch.Tensor:
    """x [M, K] times (weight [* weight_scale]) [N, K]^T (+ bias), in
    out_dtype (x's by default): one program per (row, BLOCK_N channels), for
    one row; each further row rereads the weight (from L2 at best).
    weight_scale: fp32 [N], one per output channel (e4m3 weights).
    The weight must not be written by the kernel launched just before this
    one: its first tile is read before the PDL wait (a model's parameters).
    num_stages: the weight tiles in flight per program.

    Default tiles from an 8B Llama's batch-1 decode step on an H200
    (`bench latency`, docs/benchmarks.md): 16-bit weights 8 x 1024 over 3
    stages (4.28 ms; 16 x 256 over 4 stages 4.27, 4 x 1024 over 3 4.45;
    cuBLAS 4.71); e4m3 weights 8 x 512 over 4 stages. Once the first tile
    came before the PDL wait, 8 x 1024 over 3 slowed the FP8 layers in a
    CUDA graph of the step's kernels (74.6 against 69.3 us a layer), and
    8 x 512 over 4 kept the FP8 step at 2.79-2.80 ms. The layers timed
    alone (`python -m tandem.kernels.fp8_check --bench`) rank the tiles
    differently from one lease to the next; the step decides."""
    fp8 = weight.element_size() == 1
    block_k = block_k or (512 if fp8 else 1024)
    num_stages = num_stages or (4 if fp8 else 3)
    x = _checked_operands("gemv", x, weight)
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    step = MAX_CHANNEL_TILES * block_n
    if n <= step:  # one launch, no views: eager steps pay host time per call
        _launch(x, weight, weight_scale, bias, out, block_n, block_k, num_warps, num_stages)
        return out
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        _launch(x, weight[lo:hi], None if weight_scale is None else weight_scale[lo:hi],
                None if bias is None else bias[lo:hi], out[:, lo:hi], block_n, block_k, num_warps, num_stages)
    return out


def _checked_operands(name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] with contiguous rows, for a weight [N, K] whose rows are
    contiguous (the kernels read them whole); a mismatch is a ValueError."""
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x has {x.shape[1]} features, the weight {weight.shape[1]}")
    if weight.stride(1) != 1:
        raise ValueError(f"{name}: the weight's rows must be contiguous (kernels.ops.linear sends others to torch)")
    return x if x.stride(-1) == 1 else x.contiguous()


def _operands_and_output(name: str, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x checked against weight (_checked_operands), and the [M, N] output in x's dtype."""
    x = _checked_operands(name, x, weight)
    return x, torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)


def _launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], out: torch.Tensor, block_n: int, block_k: int, num_warps: int,
            num_stages: int) -> None:
    n, k = weight.shape
    # Absent operands get any valid pointer; the constexpr flags skip their loads.
    _gemv_kernel[(x.shape[0], triton.cdiv(n, block_n))](
        x, weight, weight if weight_scale is None else weight_scale, weight if bias is None else bias, out, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages, **pdl_launch(x),
        num_warps=num_warps)


@triton.jit
def _gemv_pair_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                      HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr, PDL: tl.constexpr):
    """The one-row kernel's loop over ROWS rows of x at once: each weight
    tile, widened once, multiplies every row (the accumulator is [ROWS,
    BLOCK_N, BLOCK_K], summed over K at the end), so the weight streams from
    HBM once for all of them. The products stay on the CUDA cores, whose
    fp32 rate covers two rows of an 8B Llama's layers within their stream
    time; from four rows on cuBLAS's tensor cores win (docs/benchmarks.md,
    the thirty-first session). First weight tile before the PDL wait, as in
    the one-row kernel."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    ks = tl.arange(0, BLOCK_K)
    w_first = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
    pdl_prologue(PDL)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
    acc = w_first.to(tl.float32)[None, :, :] * x[:, None, :]
    for start in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    out = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


# Rows one program of gemv_pair multiplies: the accumulator grows with them,
# and past two rows the tensor cores win anyway.
PAIR_ROWS = 2


def gemv_pair_tiles(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, stages) of gemv_pair, 4 warps: the best of 24
    tilings at 2 bf16 rows of an 8B Llama's layers, each call reading its
    weight from HBM (H200, docs/benchmarks.md, the thirty-first session):
    wide outputs over short rows (6144 x 4096: 15.4 us, cuBLAS 16.0) take
    narrow tiles over whole 1024-wide runs of K; long rows (4096 x 14336:
    29.3, cuBLAS 31.1) 16 channels; the rest (4096 x 4096: 10.2, cuBLAS
    12.6) 8 channels by 512."""
    if k > 4096:
        return 16, 512, 3
    if n >= 6144:
        return 4, 1024, 4
    return 8, 512, 3


def gemv_pair(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              block_n: Optional[int] = None, block_k: Optional[int] = None, num_stages: Optional[int] = None,
              num_warps: int = 4) -> torch.Tensor:
    """x [M, K] times weight [N, K]^T (+ bias), 16-bit, in x's dtype, PAIR_ROWS
    rows a program: the linear layers of a decode step of two sequences over
    weights too large for the few-row kernel (kernels.ops.linear). Any M
    works (M > PAIR_ROWS rereads the weight once a pair). The weight must
    not be written by the kernel launched just before (as gemv). Tiles left
    out come from gemv_pair_tiles. Twin: torch.nn.functional.linear."""
    x, out = _operands_and_output("gemv_pair", x, weight)
    (m, k), n = x.shape, weight.shape[0]
    if m == 0:
        return out
    tiles = gemv_pair_tiles(n, k)
    block_n, block_k, num_stages = block_n or tiles[0], block_k or tiles[1], num_stages or tiles[2]
    if triton.cdiv(n, block_n) > MAX_CHANNEL_TILES:
        raise ValueError(f"gemv_pair: {n} outputs are more than {MAX_CHANNEL_TILES} tiles of {block_n}")
    _gemv_pair_kernel[(triton.cdiv(m, PAIR_ROWS), triton.cdiv(n, block_n))](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=PAIR_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages,
        **pdl_launch(x), num_warps=num_warps)
    return out


# Rows of x one program of the few-row kernel multiplies at once (the
# smallest tile tl.dot takes): the most rows gemv_rows takes.
FEW_ROWS_TILE = 16


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Up to BLOCK_M rows of x at once, each program BLOCK_N output channels
    of all of them: the weight tile is read once for every row and the rows
    ride on one tensor-core product (rows past M are masked to zero), where
    the one-row kernel's grid rereads the weight once a row and cuBLAS's
    small-M GEMMs take no dependent launch. Like the one-row kernel, the
    first weight tile is asked for before the PDL wait."""
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    ks = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
    pdl_prologue(PDL)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
    acc = mma(x, tl.trans(w), DOT_PRECISION, DOT_UPCAST)
    for start in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        ks = start + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        acc += mma(x, tl.trans(w), DOT_PRECISION, DOT_UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def few_rows_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, stages, warps) of the few-row kernel for an N x K
    weight. From a sweep of 32 tilings over SmolLM2-135M's and an 8B
    Llama's layers at 2, 5 and 16 bf16 rows, each call reading its weight
    from HBM (H200, one lease, docs/benchmarks.md): narrow outputs want more
    programs (16 channels each), and rows that fit one 1024-wide tile are
    read in one go; wider outputs take 32 channels in three stages."""
    if n <= 1024:
        return (16, 1024, 2, 4) if k <= 1024 else (16, 512, 3, 4)
    return (32, 128, 3, 4) if k <= 1024 else (32, 256, 3, 4)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              block_n: Optional[int] = None, block_k: Optional[int] = None, num_stages: Optional[int] = None,
              num_warps: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (M <= FEW_ROWS_TILE) times weight [N, K]^T (+ bias), 16-bit
    or fp32, in x's dtype: the linear layers of a verifying step of one
    sequence (1 + k rows) and of decode steps of a few sequences
    (kernels.ops.linear). The weight must not be written by the kernel
    launched just before (as gemv). Tiles left out come from
    few_rows_tiles. Twin: torch.nn.functional.linear."""
    if x.shape[0] > FEW_ROWS_TILE:
        raise ValueError(f"gemv_rows: {x.shape[0]} rows, more than one tile of FEW_ROWS_TILE ({FEW_ROWS_TILE})")
    x, out = _operands_and_output("gemv_rows", x, weight)
    (m, k), n = x.shape, weight.shape[0]
    if m == 0:
        return out
    tiles = few_rows_tiles(n, k)
    block_n, block_k = block_n or tiles[0], block_k or tiles[1]
    num_stages, num_warps = num_stages or tiles[2], num_warps or tiles[3]
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=FEW_ROWS_TILE, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages,
        **pdl_launch(x), **dot_settings(x.dtype), num_warps=num_warps)
    return out
