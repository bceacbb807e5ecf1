"""Plain-torch twin of the FP8 linear layer: e4m3 weights with one scale per
output channel, activations quantized per token on the fly ("dynamic"
scales), the product accumulated in fp32 and each output scaled by its
token's and its channel's scales. A step of one token (WEIGHT_ONLY_MAX_ROWS)
keeps its activations in the model dtype: only the weights are e4m3.

On a Hopper GPU the same arithmetic runs through torch._scaled_mm
(fp8_triton.py). Here the e4m3 values are turned back into fp32 and multiplied
there: every e4m3 value is exact in fp32, so this computes what the FP8
GEMM computes up to the order of the fp32 sums. It is the CPU path and the
oracle of the GPU one; it saves no memory bandwidth.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INV_FP8_MAX = 1.0 / FP8_MAX
# A row of zeros gets this scale instead of 0 (whose inverse is inf).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

# Up to this many rows (tokens in a step) the activations are not quantized:
# the row, in the model dtype, multiplies the e4m3 weights ("W8A16", as FP8
# Marlin kernels do). A decode step of one sequence reads every weight once,
# so FP8's gain there is the weight bytes alone, and quantizing the row
# costs without paying: on CUDA a quantizer launch before gate/up and down
# (0.21 ms of a 4.4 ms Llama-3-8B step on an H100) or its work repeated in
# every GEMV program, and an e4m3 rounding of every activation. Above it the
# rows are quantized per token for the FP8 tensor cores, where a tile of
# weights serves many rows. (On CUDA the FP8 GEMM at one row was slower than
# bf16, 5.96 against 5.50 ms a step on the H200: its 128-channel tiles leave
# most multiprocessors idle; the CUDA-core GEMV of gemv_triton.py serves it.)
WEIGHT_ONLY_MAX_ROWS = 1


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x [M, K], fp32 scales [M, 1]) with x ~= q * scale: each row's
    largest magnitude maps to e4m3's largest finite value."""
    xf = x.float()
    # amax times 1/448 rather than amax / 448: torch divides by a number as a
    # multiplication by its inverse on CUDA and not on the CPU; this way the
    # CPU, CUDA and the Triton kernel get the same bits.
    scale = (xf.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight [N, K] as e4m3 with one fp32 scale per output
    channel [N]: the same rule as the activations', along the other axis."""
    q, scale = quantize_rows_torch(weight)
    return q, scale.reshape(-1)


def quantize_stacked(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] (an MoE layer's experts) as e4m3 with one
    fp32 scale per expert and output channel [E, N]: quantize_weight's rule
    for each expert."""
    q, scale = quantize_weight(weight.reshape(-1, weight.shape[-1]))
    return q.view(weight.shape), scale.view(weight.shape[:2])


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from e4m3 [N, K] and per-channel scales [N]."""
    return weight.float() * scale.float().reshape(-1, 1)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, weight_fp32: Optional[torch.Tensor] = None,
                     weight_only: Optional[bool] = None) -> torch.Tensor:
    """x [M, K] (any float dtype) times the e4m3 weight [N, K] with scales [N],
    in x's dtype. weight_fp32: the weight's e4m3 values already in fp32 (a
    caller that keeps them saves the conversion each call). weight_only:
    leave x unquantized (None: when M <= WEIGHT_ONLY_MAX_ROWS)."""
    if weight_only is None:
        weight_only = x.shape[0] <= WEIGHT_ONLY_MAX_ROWS
    w = weight.float() if weight_fp32 is None else weight_fp32
    if weight_only:
        out = (x.float() @ w.t()) * weight_scale.float().reshape(1, -1)
    else:
        q, x_scale = quantize_rows_torch(x)
        out = (q.float() @ w.t()) * x_scale * weight_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
