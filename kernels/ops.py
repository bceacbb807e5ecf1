"""Dispatch: Triton kernels on CUDA tensors, torch twins everywhere else
(TANDEM_ATTENTION_BACKEND=torch: the twins on CUDA too)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from tandem.kernels.metadata import AttentionMetadata
from tandem.kernels.layer_ops_torch import rms_norm_torch, rotary_torch, silu_and_mul_torch
from tandem.kernels.paged_attention_torch import paged_attention_torch_batched, write_kv_torch


def triton_backend_selected() -> bool:
    """False when TANDEM_ATTENTION_BACKEND=torch forces the twins (debugging on a GPU)."""
    return os.environ.get("TANDEM_ATTENTION_BACKEND", "triton") == "triton"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_backend_selected()


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if _use_triton(key):
        from tandem.kernels.cache_write import write_kv_triton

        write_kv_triton(key, value, kv_cache, slot_mapping)
    else:
        write_kv_torch(key, value, kv_cache, slot_mapping)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    if _use_triton(query):
        from tandem.kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(query, kv_cache, meta, scale)
    return paged_attention_torch_batched(query, kv_cache, meta, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(RMSNorm(x [+ residual]), the new residual or None); see layer_ops_torch.py."""
    if _use_triton(x):
        from tandem.kernels.layer_ops_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k after the rotary embedding (in place on CUDA)."""
    if _use_triton(q):
        from tandem.kernels.layer_ops_triton import rotary_triton

        return rotary_triton(q, k, cos, sin)
    return rotary_torch(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _use_triton(gate_up):
        from tandem.kernels.layer_ops_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)
