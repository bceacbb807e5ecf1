"""Dispatch: Triton kernels on CUDA tensors, torch twins everywhere else
(attention backend "torch": the twins on CUDA too).

The backend is one setting per process, not per call: the model's layers call
these functions directly, without an engine object to ask. The engine sets it
from its config (EngineConfig.attention_backend, flag --attention-backend)
when it starts; until then it is "auto".
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from tandem.kernels.fp8_torch import fp8_linear_torch, quantize_rows_torch
from tandem.kernels.fused_moe_torch import fused_moe_torch, route_torch
from tandem.kernels.metadata import AttentionMetadata
from tandem.kernels.layer_ops_torch import rms_norm_torch, rotary_torch, silu_and_mul_torch
from tandem.kernels.paged_attention_torch import paged_attention_torch_batched, write_kv_torch

# The names of engine/config.py's AttentionBackend.
BACKENDS = ("auto", "triton", "torch")
_backend = "auto"


def set_attention_backend(name: str, device_type: str) -> None:
    """Select the kernels of this process for an engine on `device_type`.
    "triton" on another device than CUDA is an error rather than a silent
    fall back to the twins."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "triton" and device_type != "cuda":
        raise ValueError(f"--attention-backend triton needs CUDA; this engine runs on {device_type}: "
                         "use --attention-backend auto or torch")
    _backend = name


def attention_backend() -> str:
    return _backend


def triton_backend_selected() -> bool:
    """False when the backend is "torch": the twins run on CUDA too (debugging on a GPU)."""
    return _backend != "torch"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_backend_selected()


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k_scale / v_scale: an FP8 cache stores key / k_scale and value / v_scale."""
    if _use_triton(key):
        from tandem.kernels.cache_write import write_kv_triton

        write_kv_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, new_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """new_kv: the (key, value) rows write_kv just put in the cache; the Triton
    path may read the new tokens' tiles from them (paged_attention_triton),
    the twin reads the cache only."""
    if _use_triton(query):
        from tandem.kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(query, kv_cache, meta, scale, new_kv=new_kv)
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


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary(q, k, cos, sin), then write_kv of the rotated k and v: one
    launch on CUDA (rotary_kv_write_triton.py). Returns (q, k), rotated."""
    if _use_triton(q):
        from tandem.kernels.rotary_kv_write_triton import rotary_write_kv_triton

        return rotary_write_kv_triton(q, k, v, cos, sin, kv_cache, slot_mapping, k_scale, v_scale)
    q, k = rotary_torch(q, k, cos, sin)
    write_kv_torch(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _use_triton(gate_up):
        from tandem.kernels.layer_ops_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_torch(gate_up)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, expert ids) of each token from router logits [T, E];
    see fused_moe_torch.route_torch."""
    if _use_triton(router_logits):
        from tandem.kernels.moe_routing_triton import route_triton

        return route_triton(router_logits, top_k, renormalize, weights_dtype)
    return route_torch(router_logits, top_k, renormalize, weights_dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's top-k experts' SwiGLU MLPs, weighted and summed (e4m3
    experts and activations when the scales are given); see fused_moe_torch.py."""
    if _use_triton(hidden):
        from tandem.kernels.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return fused_moe_torch(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


# TANDEM_GEMV=0 keeps few-row 16-bit products with torch (cuBLAS), so that one
# lease can time the engine with and without the GEMV kernels (docs/benchmarks.md).
GEMV_ENV = "TANDEM_GEMV"
_gemv_on = os.environ.get(GEMV_ENV, "1") != "0"
# The most rows the few-row kernel takes (gemv_triton.FEW_ROWS_TILE, one tile).
FEW_ROWS_MAX = 16
# Products that stay with cuBLAS however few their rows, from the H200 sweeps
# of docs/benchmarks.md (each call reading its weight from HBM): outputs this
# wide (LM heads) over rows shorter than 1024 (SmolLM2's 49152 x 576 head, one
# row: cuBLAS 16.5 us, the GEMV 25.2, the few-row kernel 18.3), and weights
# of more elements than FEW_ROWS_MAX_WEIGHT. The few-row kernel's gains were
# measured in the step on layers of up to 1.8M elements (SmolLM2-135M); an
# 8B Llama's layers (16.8M and more) it streamed at cuBLAS's speed alone
# (28672 x 4096 at 5 rows: 59.3 against 56.9 us), so they stay with cuBLAS.
WIDE_N = 32768
FEW_ROWS_MAX_WEIGHT = 1 << 23
# Two rows over those larger weights take gemv_pair (the CUDA cores), but
# for outputs this wide, which cuBLAS streams faster (an 8B Llama's
# 28672 x 4096 gate/up at 2 rows: 56.3 against 59.3 us; H200,
# docs/benchmarks.md, the thirty-first session).
PAIR_MAX_N = 16384


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] times weight [N, K]^T (+ bias), as torch.nn.functional.linear.
    On CUDA, 16-bit products of a few rows take the Triton kernels of
    gemv_triton.py: one row (a decode step of one sequence) the GEMV, which
    streams the weight faster than cuBLAS's split-K GEMV; 2 to FEW_ROWS_MAX
    rows (a verifying step of one sequence, decode steps of a few) the
    few-row kernel, which reads each weight tile once for all of them and
    waits for the kernel before on the GPU (a dependent launch), where
    cuBLAS's small-M GEMMs take 3-5 us a call however small the layer, and
    leave the GPU idle between launches. Two rows over larger weights take
    gemv_pair (an 8B Llama's batch-2 step period 4.72 -> 4.43 ms, H200).
    fp32 rows keep cuBLAS's arithmetic (the token-exact GPU tests run in
    fp32), and more rows reuse each weight tile enough for cuBLAS."""
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if (_gemv_on and 1 <= rows <= FEW_ROWS_MAX and _use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(-1) == 1):  # the kernels read weight rows whole
        from tandem.kernels.gemv_triton import PAIR_ROWS, gemv, gemv_pair, gemv_rows

        if rows == 1 and not (n >= WIDE_N and k < 1024):
            return gemv(x.reshape(1, k), weight, bias).reshape(*x.shape[:-1], n)
        if rows > 1 and n < WIDE_N and n * k <= FEW_ROWS_MAX_WEIGHT:
            return gemv_rows(x.reshape(rows, k), weight, bias).reshape(*x.shape[:-1], n)
        if rows == PAIR_ROWS and n < PAIR_MAX_N:
            return gemv_pair(x.reshape(rows, k), weight, bias).reshape(*x.shape[:-1], n)
    return torch.nn.functional.linear(x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None, weight_fp32: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] times an e4m3 weight [N, K] with per-channel scales [N], the
    activations quantized per token above WEIGHT_ONLY_MAX_ROWS rows
    (fp8_torch.py). On CUDA the Triton GEMV and the FP8 GEMM run whatever the
    backend (the torch backend quantizes with the twin); weight_fp32 serves
    the twin only."""
    if x.is_cuda:
        from tandem.kernels.fp8_triton import fp8_linear_cuda, quantize_rows_triton

        quantize = quantize_rows_triton if triton_backend_selected() else quantize_rows_torch
        return fp8_linear_cuda(x, weight, weight_scale, bias, quantize=quantize)
    return fp8_linear_torch(x, weight, weight_scale, bias, weight_fp32)
