"""Dispatch: Triton kernels on CUDA tensors, torch twins everywhere else."""
from __future__ import annotations

import os

import torch

from tandem.kernels.metadata import AttentionMetadata
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
