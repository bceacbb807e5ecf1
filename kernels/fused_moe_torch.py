"""Plain-torch twin of the fused mixture-of-experts MLP (fused_moe_triton.py).

Each token runs the SwiGLU MLPs of its top-k experts; each expert's output
is scaled by the token's routing weight for it, and the k scaled outputs are
summed. This is the reference the Triton kernel is checked against and the
path on the CPU.

It goes expert by expert, rounding to the activation dtype where HF
transformers' eager experts round (the gate/up product, SiLU, its product
with up, the down projection, the weighted output), so on the CPU greedy
output stays HF's token for token.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from tandem.kernels.layer_ops_torch import silu_and_mul_torch


def fused_moe_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up
    rows); w2 [E, H, I]; topk_weights [T, k] (any float dtype: the product
    with an expert's output is taken in the wider of the two dtypes, then
    rounded, as HF does); topk_ids [T, k], distinct experts per token.
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
        act = silu_and_mul_torch(F.linear(hidden[tokens], w13[expert]))
        y = F.linear(act, w2[expert]) * flat_weights[rows, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
