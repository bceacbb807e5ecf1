"""Plain-torch twins of the per-layer ops around attention: RMSNorm (with
the residual add folded in), rotary embedding and SiLU-and-multiply.

They compute what HF transformers' Llama modules compute, rounding to the
activation dtype at the same points (an fp32 RMSNorm whose normalised value
is rounded before the weight multiplies it; each product and sum of the
rotation rounded; SiLU rounded before the multiply), so on the CPU greedy
output stays token for token HF's. The Triton kernels in layer_ops_triton.py
round at the same points.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm over the last dimension. With `residual`: first residual = x +
    residual (in x's dtype), then the norm of that; returns (normed, residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def rotary_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D]; cos/sin [T, D]. HF's rotate-half convention."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, up second) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
