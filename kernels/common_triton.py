"""Pieces the Triton kernels share."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from tandem.kernels.kv_cache_dtype import is_fp8


def interpreted() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_settings(dtype: torch.dtype) -> dict:
    """Constexpr arguments for `mma` given the operands' dtype.

    fp32 operands get exact ("ieee") products rather than tf32, so fp32 runs
    can serve as a tight check. Triton's CPU interpreter multiplies bf16 tiles
    as their raw uint16 bit patterns (seen with triton 3.9), so there the
    operands are widened to fp32 first; products of bf16 values are exact in
    fp32, so the numbers match what the GPU's bf16 MMA with fp32 accumulation
    gives. The GPU never takes that branch.
    """
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": interpreted() and dtype == torch.bfloat16,
    }


def fp16_products(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether attention over this cache multiplies in fp16: an FP8 (e4m3)
    cache beside bf16 or fp16 queries. e4m3 widens to fp16 in one instruction
    for two values (sm89+), to bf16 only through fp32: in bf16 the widening
    cost more than the halved reads saved (H200, docs/benchmarks.md). Exact
    either way (e4m3 values are fp16 values); the queries become fp16 too,
    whose range holds any real query, and the softmax weights, in [0, 1],
    round to fp16 instead of bf16 before P @ V (three more bits)."""
    return is_fp8(cache_dtype) and query_dtype in (torch.bfloat16, torch.float16)


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if DOT_UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PRECISION)
    return c


# Programmatic dependent launch (Hopper and later): a kernel launched with it
# may start while the kernel before it in the stream finishes, and waits
# (pdl_prologue) for that kernel's memory before it touches it. Inside a
# decode step's CUDA graph that hides each launch's latency between the small
# kernels of a layer (docs/kernels.md). TANDEM_PDL=0 turns it off.
PDL_ENV = "TANDEM_PDL"


@functools.lru_cache(maxsize=None)
def _pdl_on(device_index: int) -> bool:
    if os.environ.get(PDL_ENV, "1") == "0" or interpreted():
        return False
    import dataclasses

    import triton.language.extra.cuda as cuda_extra
    from triton.backends.nvidia.compiler import CUDAOptions

    launch_option = "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
    if not (launch_option and hasattr(cuda_extra, "gdc_wait")):  # a Triton before programmatic launch
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch."""
    return t.is_cuda and _pdl_on(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel that starts with pdl_prologue, for
    t's device: its PDL constexpr and Triton's launch_pdl, always equal (a
    dependent launch without the kernel's wait would race the kernel before)."""
    on = pdl_enabled(t)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Called by a kernel launched with launch_pdl=PDL before it reads what
    an earlier kernel wrote or writes anything (as its first statement, or
    after loads of memory no kernel of the step writes, such as the GEMV's
    weights): wait until the kernel before it has finished and its writes
    are visible, then let the kernel after it be
    launched, so that its programs are resident and waiting when this one
    ends. Without PDL both are no-ops and are left out."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
