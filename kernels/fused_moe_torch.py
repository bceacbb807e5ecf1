"""Plain-torch twin of the fused mixture-of-experts MLP (fused_moe_triton.py).

Each token runs the SwiGLU MLPs of its top-k experts; each expert's output
is scaled by the token's routing weight for it, and the k scaled outputs are
summed. This is the reference the Triton kernel is checked against and the
path on the CPU.

FP8 experts (engine/fp8.py) come as e4m3 weights with one fp32 scale per
expert and output channel: a projection is the activation times the e4m3
values, summed in fp32, times the channel's scale, then rounded to the
activation dtype, which is what the kernel computes (every e4m3 value and
every product of one with a bf16 value is exact in fp32). The activations
are e4m3 too ("W8A8", for the FP8 tensor cores): each row an expert
multiplies (a token's hidden state, then its SiLU-and-multiply output) is
quantized with one scale of its own (fp8_torch.quantize_rows_torch's rule,
"dynamic per-token" scales), and a product is scaled by its row's and its
channel's scale. fp8_activations=False keeps them in the model dtype
("W8A16"), for comparison only: on an H200 the MoE layer of Qwen3-30B-A3B
ran 1.1-2.3x faster in W8A8 at 1 to 4,096 tokens, quantizing launches
included (docs/benchmarks.md), unlike the dense layers, whose one-row GEMV
stays weight-only (fp8_torch.WEIGHT_ONLY_MAX_ROWS).

It goes expert by expert, rounding to the activation dtype where HF
transformers' eager experts round (the gate/up product, SiLU, its product
with up, the down projection, the weighted output), so on the CPU greedy
output stays HF's token for token.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from tandem.kernels.fp8_torch import fp8_linear_torch
from tandem.kernels.layer_ops_torch import silu_and_mul_torch


def route_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in weights_dtype, expert ids [T, k]) from router
    logits [T, E], as HF routes Qwen3-MoE and Mixtral: softmax over all
    experts in fp32, the top k, renormalised to sum to 1 when asked, then
    rounded to weights_dtype. Twin of moe_routing_triton.py."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor],
                  fp8_activations: bool = True) -> torch.Tensor:
    """x [M, K] times one expert's weight [N, K]; with scale [N], the weight
    is e4m3 and the product is scaled per channel in fp32, and with
    fp8_activations each row of x is quantized to e4m3 first and the product
    scaled by its row's scale too (module docstring)."""
    if scale is None:
        return F.linear(x, weight)
    return fp8_linear_torch(x, weight, scale, weight_only=not fp8_activations)


def fused_moe_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                    fp8_activations: bool = True) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up
    rows); w2 [E, H, I]; topk_weights [T, k] (any float dtype: the product
    with an expert's output is taken in the wider of the two dtypes, then
    rounded, as HF does); topk_ids [T, k], distinct experts per token.
    w13_scale [E, 2I] and w2_scale [E, H]: given for e4m3 experts, one fp32
    scale per expert and output channel; fp8_activations=False leaves the
    activations of e4m3 experts unquantized (W8A16, module docstring).
    Returns [T, H] in hidden's dtype."""
    out = torch.zeros_like(hidden)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    flat_weights = topk_weights.reshape(-1)
    # Rows of the flattened [T * k] routing, grouped by expert.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start:start + n]
        start += n
        tokens = rows // top_k
        gate_up = expert_linear(hidden[tokens], w13[expert], None if w13_scale is None else w13_scale[expert],
                                fp8_activations)
        act = silu_and_mul_torch(gate_up)
        down = expert_linear(act, w2[expert], None if w2_scale is None else w2_scale[expert], fp8_activations)
        y = down * flat_weights[rows, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
