"""Pieces the Triton attention kernels share."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def dot_settings(dtype: torch.dtype) -> dict:
    """Constexpr arguments for `mma` given the operands' dtype.

    fp32 operands get exact ("ieee") products rather than tf32, so fp32 runs
    can serve as a tight check. Triton's CPU interpreter multiplies bf16 tiles
    as their raw uint16 bit patterns (seen with triton 3.9), so there the
    operands are widened to fp32 first; products of bf16 values are exact in
    fp32, so the numbers match what the GPU's bf16 MMA with fp32 accumulation
    gives. The GPU never takes that branch.
    """
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": interpreted and dtype == torch.bfloat16,
    }


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if DOT_UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PRECISION)
    return c
