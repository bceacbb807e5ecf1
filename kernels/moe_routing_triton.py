"""Mixture-of-experts routing in one launch: router logits [T, E] -> the
top-k weights and expert ids of each token.

As HF transformers routes Qwen3-MoE and Mixtral (twin: route_torch in
fused_moe_torch.py): softmax over all experts in fp32, the k largest
probabilities in descending order (equal ones by the lower expert id),
optionally renormalised to sum to 1, rounded to the weights' dtype.

Why a kernel: the same in torch is six launches or more (widen, softmax,
top-k and the sort after it, sum, divide, round). In a Qwen3-30B-A3B decode
step at batch 1 on an H200 the top-k and its sort alone took 9 us of each
MoE layer; this kernel takes 3.3 us (docs/benchmarks.md, thirteenth session).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.common_triton import pdl_launch, pdl_prologue


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits,
                  TOKENS: tl.constexpr, EXPERTS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_ok = t < num_tokens
    e = tl.arange(0, EXPERTS)
    e_ok = e < num_experts
    x = tl.load(logits_ptr + t[:, None] * stride_logits + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # Experts past num_experts (padding) rank below every real one.
    p = tl.where(e_ok[None, :], p, -1.0)
    slot = tl.arange(0, K_PAD)
    weights = tl.zeros((TOKENS, K_PAD), dtype=tl.float32)
    ids = tl.zeros((TOKENS, K_PAD), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        # the lowest expert id among those at the maximum
        pick = tl.min(tl.where(p == best[:, None], e[None, :], EXPERTS), axis=1)
        weights = tl.where(slot[None, :] == i, best[:, None], weights)
        ids = tl.where(slot[None, :] == i, pick[:, None], ids)
        p = tl.where(e[None, :] == pick[:, None], -2.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = t[:, None] * TOP_K + slot[None, :]
    ok = t_ok[:, None] & (slot < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, ids.to(ids_ptr.dtype.element_ty), mask=ok)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in weights_dtype, expert ids [T, k] int64) from
    router_logits [T, E]; see the module docstring."""
    tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        raise ValueError("route_triton: the router logits' last dimension must be dense")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"route_triton: top_k {top_k} must be in 1..{num_experts}")
    weights = torch.empty((tokens, top_k), dtype=weights_dtype, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, ids
    experts = triton.next_power_of_2(num_experts)
    # about 4096 probabilities a program: 32 tokens of 128 experts
    per_program = max(1, min(triton.next_power_of_2(tokens), 4096 // experts))
    _route_kernel[(triton.cdiv(tokens, per_program),)](
        router_logits, weights, ids, tokens, num_experts, router_logits.stride(0), TOKENS=per_program,
        EXPERTS=experts, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        **pdl_launch(router_logits))
    return weights, ids
