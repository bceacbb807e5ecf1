"""Fused mixture-of-experts MLP in two grouped GEMM launches.

A batch of T tokens routed to k experts each is T * k (token, expert) rows.
They are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M, so every BLOCK_M-row tile of the sorted order belongs to one expert
(align_by_expert: one launch for a decode step's rows, torch ops for more).
Then:

1. gate/up: one launch over all tiles; a tile multiplies its rows' hidden
   states by its expert's gate and up weights (two accumulators over the same
   columns) and stores silu(gate) * up, [T * k, I];
2. down: one launch; a tile multiplies those by its expert's down weights,
   scales each row by its routing weight and stores it, [T * k, H];
3. combine: the k rows of each token are summed (a launch of its own).

Why: looping over experts in torch is a host round trip and a few small
GEMMs per expert (128 experts: hundreds of launches per layer, and the host
must read how many tokens each expert got). Here the number of launches is
fixed and nothing is read back, so a decode step can be a CUDA graph: the
padded row count is bounded by T * k + min(E, T * k) * (BLOCK_M - 1), the
grid is sized for that bound, and tiles past the real end exit at once.

Twin: fused_moe_torch.py. Rounding to the activation dtype happens where the
twin (and HF transformers) rounds; accumulation is fp32.

FP8 experts (e4m3 weights, an fp32 scale per expert and output channel):
- W8A8 (always; fused_moe_torch.py says why): the hidden states, then
  gate/up's output, are quantized per row (fp8_triton.quantize_rows_triton:
  a launch before each GEMM), so the products run on the FP8 tensor cores
  with no widening of the weights.
  Quantizing in the GEMMs instead, as each tile is loaded, repeats a row's
  division for every program of its columns: on an H200 that layer ran 2-4x
  slower than W8A16 (docs/benchmarks.md).
- W8A16 (fp8_activations=False, for comparison): a tile's e4m3 weights are
  widened to the activation dtype (exact) on their way into the model
  dtype's products.
Each accumulated column is scaled by its row's scale (W8A8) and its
channel's before the rounding, in the twin's order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import dot_settings, mma, pdl_launch, pdl_prologue
from tandem.kernels.fp8_triton import quantize_rows_triton


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, tile_experts) for topk_ids [T, k].

    sorted_rows [num_tiles * block_m] (int32): indices into the flattened
    [T * k] routing, grouped by expert, in row order within an expert, each
    expert's group padded to a multiple of block_m with T * k (a row that
    does not exist).
    tile_experts [num_tiles] (int32): the expert of each tile; num_experts for
    the tiles past the last expert's group.

    Torch ops without a host synchronisation (the sizes depend on T, k and E
    only), so the whole layer can be captured in a CUDA graph. About twenty
    launches, though: align_by_expert takes the one-launch kernel below when
    the rows fit it."""
    flat = topk_ids.reshape(-1)
    num_rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    # a row's rank within its expert's group, then its place in the padded order
    rank = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[experts_in_order]
    dest = padded_start[experts_in_order] + rank
    num_tiles = _num_tiles(num_rows, num_experts, block_m)
    sorted_rows = torch.full((num_tiles * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, dtype=torch.int64, device=device) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return sorted_rows, tile_experts


def _num_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    # Only experts that got a row are padded, and at most block_m - 1 rows each.
    return triton.cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m)


# The one-launch alignment: every program reads all the rows' experts (4096
# int64 are 32 KiB), so it takes up to this many rows (a decode step of 512
# tokens at top-8); larger batches are prefill, where twenty launches weigh
# little beside the GEMMs.
ALIGN_MAX_ROWS = 4096
_ALIGN_CHUNK = 128  # rows a program places
_ALIGN_TILES = 32  # tiles a program labels


@triton.jit(do_not_specialize=["num_rows", "num_tiles"])
def _align_kernel(ids_ptr, sorted_rows_ptr, tile_experts_ptr, num_rows, num_experts, num_tiles,
                  ROWS: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr, TILES: tl.constexpr,
                  BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """align_by_expert_torch's result. Each program counts every expert's
    rows (a histogram of all of them) and so knows each padded group's
    start; then it places its CHUNK rows, a row going after its expert's
    rows in the chunks before (a histogram of those) and in its own chunk
    before it (a CHUNK x CHUNK comparison), which is the torch path's
    stable order; then it labels its TILES tiles with their expert and
    fills their padding slots. Rows and padding are disjoint slots, so the
    programs need no order among them."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)
    # Rows past the end take expert num_experts (EXPERTS > num_experts), which counts nowhere.
    ids = tl.load(ids_ptr + r, mask=r < num_rows, other=num_experts).to(tl.int32)
    e = tl.arange(0, EXPERTS)
    real_expert = e < num_experts
    counts = tl.where(real_expert, tl.histogram(ids, EXPERTS), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded

    first = pid * CHUNK
    before = tl.histogram(tl.where(r < first, ids, num_experts), EXPERTS)
    c = tl.arange(0, CHUNK)
    mine = tl.load(ids_ptr + first + c, mask=first + c < num_rows, other=num_experts).to(tl.int32)
    rank = tl.sum(((mine[:, None] == mine[None, :]) & (c[None, :] < c[:, None])).to(tl.int32), axis=1)
    dest = tl.gather(padded_start + before, mine, 0) + rank
    tl.store(sorted_rows_ptr + dest, first + c, mask=mine < num_experts)

    t = pid * TILES + tl.arange(0, TILES)
    t_ok = t < num_tiles
    # a tile's expert: how many real experts' padded groups end at or before its first slot
    ended = (padded_end[None, :] <= (t * BLOCK_M)[:, None]) & real_expert[None, :]
    expert = tl.sum(ended.to(tl.int32), axis=1)
    tl.store(tile_experts_ptr + t, expert, mask=t_ok)
    # Padding: the slots past the expert's rows (all of a tile past the last group:
    # expert num_experts has no rows and starts where the last group ends).
    offset = (t * BLOCK_M - tl.gather(padded_start, expert, 0))[:, None] + tl.arange(0, BLOCK_M)[None, :]
    slots = t[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_rows_ptr + slots, num_rows, mask=t_ok[:, None] & (offset >= tl.gather(counts, expert, 0)[:, None]))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert_torch's result; in one launch when the rows fit
    ALIGN_MAX_ROWS (a decode step's MoE layer is otherwise twenty-odd small
    launches, most of a layer's time at batch 1)."""
    num_rows = topk_ids.numel()
    if num_rows == 0 or num_rows > ALIGN_MAX_ROWS:
        return align_by_expert_torch(topk_ids, num_experts, block_m)
    num_tiles = _num_tiles(num_rows, num_experts, block_m)
    device = topk_ids.device
    sorted_rows = torch.empty(num_tiles * block_m, dtype=torch.int32, device=device)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=device)
    rows = max(16, triton.next_power_of_2(num_rows))
    chunk = min(_ALIGN_CHUNK, rows)
    programs = max(triton.cdiv(num_rows, chunk), triton.cdiv(num_tiles, _ALIGN_TILES))
    _align_kernel[(programs,)](topk_ids.reshape(-1), sorted_rows, tile_experts, num_rows, num_experts, num_tiles,
                               ROWS=rows, EXPERTS=triton.next_power_of_2(num_experts + 1), CHUNK=chunk,
                               TILES=_ALIGN_TILES, BLOCK_M=block_m, **pdl_launch(topk_ids))
    return sorted_rows, tile_experts


@triton.jit
def _gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, rows_ptr, experts_ptr,
                    num_rows, num_experts, top_k, hidden, inter,
                    stride_x, stride_we, stride_wn, stride_se, stride_out,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    FP8: tl.constexpr, A8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    expert = tl.load(experts_ptr + tile).to(tl.int64)
    if expert >= num_experts:
        return
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    tokens = rows // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w = w_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        # [BLOCK_K, BLOCK_N] tiles of W^T: gate rows `cols`, up rows `inter + cols`
        b_gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        b_up = tl.load(w + (inter + cols)[None, :] * stride_wn + ks[:, None], mask=b_mask, other=0.0)
        if FP8 and not A8:
            b_gate = b_gate.to(a.dtype)
            b_up = b_up.to(a.dtype)
        acc_gate += mma(a, b_gate, DOT_PRECISION, DOT_UPCAST)
        acc_up += mma(a, b_up, DOT_PRECISION, DOT_UPCAST)
    if A8:
        row_scale = tl.load(x_scale_ptr + tokens, mask=row_ok, other=0.0)[:, None]
        acc_gate *= row_scale
        acc_up *= row_scale
    if FP8:
        scales = scale_ptr + expert * stride_se
        acc_gate *= tl.load(scales + cols, mask=col_ok, other=0.0)[None, :]
        acc_up *= tl.load(scales + inter + cols, mask=col_ok, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], (act * up).to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, act_scale_ptr, w_ptr, scale_ptr, out_ptr, weights_ptr, rows_ptr, experts_ptr,
                 num_rows, num_experts, hidden, inter,
                 stride_act, stride_we, stride_wn, stride_se, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FP8: tl.constexpr, A8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    expert = tl.load(experts_ptr + tile).to(tl.int64)
    if expert >= num_experts:
        return
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * stride_act + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8 and not A8:
            b = b.to(a.dtype)
        acc += mma(a, b, DOT_PRECISION, DOT_UPCAST)
    if A8:
        acc *= tl.load(act_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if FP8:
        acc *= tl.load(scale_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    scale = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    # the down projection rounded, then scaled in fp32 and rounded again, as the twin does
    y = acc.to(dtype).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_rows_kernel(rows_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = the sum of rows t * TOP_K .. t * TOP_K + TOP_K - 1, in fp32,
    rounded once (what torch's sum over the k rows computes)."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + i) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


@dataclass(frozen=True)
class MoETiles:
    """One launch's tiles: BLOCK_N output columns and BLOCK_K reduction
    columns a program, and Triton's warps and pipeline stages. None: the
    defaults below. bench/moe_tiles.py sweeps them on a GPU."""
    block_n: Optional[int] = None
    block_k: Optional[int] = None
    num_warps: int = 4
    num_stages: int = 3

    def resolved(self, n: int, k: int, fp8_products: bool = False) -> tuple[int, int]:
        """(BLOCK_N, BLOCK_K) for n output and k reduction columns. FP8
        tensor-core products take at least 32 reduction columns a step."""
        block_k = self.block_k or _block(k, 64)
        return self.block_n or _block(n, 64), max(32, block_k) if fp8_products else block_k


# FP8 experts' tiles: narrower and deeper than bf16's, so more programs keep
# more e4m3 bytes in flight while each widens its tile. The sweep of
# bench/moe_tiles.py on an H200 (Qwen3-30B-A3B's shapes, docs/benchmarks.md)
# found these best at 8 and 64 tokens: the layer 13-15% faster than at the
# bf16 tiles; at 1 and 256 tokens within 3%. bf16's defaults were within 5%
# of the best found, so they stay.
FP8_GATE_UP_TILES = MoETiles(block_n=32, block_k=128, num_warps=4, num_stages=4)
FP8_DOWN_TILES = MoETiles(block_n=64, block_k=128, num_warps=4, num_stages=3)


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                     gate_up_tiles: Optional[MoETiles] = None, down_tiles: Optional[MoETiles] = None,
                     fp8_activations: bool = True) -> torch.Tensor:
    """Same contract as fused_moe_torch: hidden [T, H]; w13 [E, 2I, H]; w2
    [E, H, I]; topk_weights, topk_ids [T, k]; for e4m3 experts, fp32 scales
    w13_scale [E, 2I] and w2_scale [E, H], and fp8_activations=False for
    W8A16 instead of W8A8. Returns [T, H]."""
    tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if w13.shape != (num_experts, 2 * inter, hidden_size) or w2.shape != (num_experts, hidden_size, inter):
        raise ValueError(f"fused_moe_triton: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"hidden size {hidden_size}")
    if hidden.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe_triton: the last dimensions must be dense")
    fp8 = w13_scale is not None
    gate_up_tiles = gate_up_tiles or (FP8_GATE_UP_TILES if fp8 else MoETiles())
    down_tiles = down_tiles or (FP8_DOWN_TILES if fp8 else MoETiles())
    if fp8 != (w2_scale is not None):
        raise ValueError("fused_moe_triton: FP8 experts need both w13_scale and w2_scale")
    if fp8 and (w13_scale.shape != (num_experts, 2 * inter) or w2_scale.shape != (num_experts, hidden_size)
                or w13_scale.stride(-1) != 1 or w2_scale.stride(-1) != 1):
        raise ValueError(f"fused_moe_triton: scales {tuple(w13_scale.shape)} and {tuple(w2_scale.shape)} do not "
                         f"fit {num_experts} experts of {2 * inter} and {hidden_size} channels")
    if tokens == 0:
        return torch.zeros_like(hidden)
    a8 = fp8 and fp8_activations
    num_rows = tokens * top_k
    # A tile holds one expert's rows: small tiles when experts get few rows each (decode).
    block_m = _block(num_rows // num_experts, 64)
    sorted_rows, tile_experts = align_by_expert(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1)  # widened to fp32 in the down kernel
    dots = dot_settings(hidden.dtype)
    act = torch.empty((num_rows, inter), dtype=hidden.dtype, device=hidden.device)
    block_n, block_k = gate_up_tiles.resolved(inter, hidden_size, a8)
    # W8A8: each token's hidden state quantized once (not in every program
    # that reads it), the kernel given the e4m3 rows and their scales.
    x, x_scale = quantize_rows_triton(hidden) if a8 else (hidden, hidden)
    _gate_up_kernel[(tile_experts.numel(), triton.cdiv(inter, block_n))](
        x, x_scale, w13, w13_scale if fp8 else w13, act, sorted_rows, tile_experts, num_rows, num_experts, top_k,
        hidden_size, inter, x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0) if fp8 else 0,
        act.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, A8=a8, **dots,
        num_warps=gate_up_tiles.num_warps, num_stages=gate_up_tiles.num_stages, **pdl_launch(hidden))
    out_rows = torch.empty((num_rows, hidden_size), dtype=hidden.dtype, device=hidden.device)
    block_n, block_k = down_tiles.resolved(hidden_size, inter, a8)
    act, act_scale = quantize_rows_triton(act) if a8 else (act, act)
    _down_kernel[(tile_experts.numel(), triton.cdiv(hidden_size, block_n))](
        act, act_scale, w2, w2_scale if fp8 else w2, out_rows, weights, sorted_rows, tile_experts, num_rows,
        num_experts, hidden_size, inter, act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0) if fp8 else 0,
        out_rows.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, A8=a8, **dots,
        num_warps=down_tiles.num_warps, num_stages=down_tiles.num_stages, **pdl_launch(hidden))
    out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    block = min(1024, triton.next_power_of_2(hidden_size))
    _sum_rows_kernel[(tokens, triton.cdiv(hidden_size, block))](out_rows, out, hidden_size, TOP_K=top_k, BLOCK=block,
                                                               **pdl_launch(hidden))
    return out
