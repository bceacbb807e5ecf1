"""Check the fused-MoE Triton kernels (fused_moe_triton.py) against their torch
twin: several expert counts, top-k 1 and 2 (and 3: a sum of more than two),
an expert that gets no row, one expert that gets every row, a single token
and none; fp32 and bf16; widths that are not powers of two; and each of these
with FP8 experts (e4m3 weights, a scale per expert and output channel), their
activations left in the model dtype (W8A16) and quantized per row (W8A8).
Then the one-launch alignment (rows sorted by expert, groups padded to the
tile) against its torch twin, value for value, up to the kernel's row limit;
and the one-launch routing (softmax, top k, renormalising) against its twin.

    TRITON_INTERPRET=1 python -m tandem.kernels.fused_moe_check --device cpu   # CI, no GPU
    python -m tandem.kernels.fused_moe_check --device cuda                     # on a GPU

Exit status 0 when every case agrees; the last line says how many were checked.
"""
from __future__ import annotations

import sys

import torch

from tandem.kernels.check_runner import check_parser, relative_error, run_checks
from tandem.kernels.fp8_torch import quantize_stacked
from tandem.kernels.fused_moe_torch import fused_moe_torch
from tandem.kernels.layer_ops_check import TOLERANCE

# Relative to the largest magnitude of the reference, as layer_ops_check.py
# measures. bf16 gets about three times layer_ops_check's allowance: a row is
# rounded seven times in a chain (gate, up, SiLU, SiLU * up, down, the
# weighted output, the sum of a token's k rows), and Triton's interpreter
# rounds each by truncation where torch rounds to nearest (measured: up to
# 3.4e-2 in these cases). A wrong expert or a missing weight is off by far
# more (1.0 and beyond).
MOE_TOLERANCE = {**TOLERANCE, torch.bfloat16: 2 ** -4.5}


# W8A8, fp32 activations too: on a GPU the products run on the FP8 tensor
# cores, whose accumulator keeps fewer bits than fp32 (fp8_check's
# FP8_GEMM_TOLERANCE), and gate/up's outputs may differ from the twin's in
# their last bits, which can round an activation to the neighbouring e4m3
# value (a step of 1/16 to 1/8) before the down projection. bf16's
# allowance, still far below a wrong expert's error.
W8A8_TOLERANCE = MOE_TOLERANCE[torch.bfloat16]


def close(out: torch.Tensor, ref: torch.Tensor, w8a8: bool = False) -> tuple[bool, float]:
    err = relative_error(out, ref)
    return err <= (W8A8_TOLERANCE if w8a8 else MOE_TOLERANCE[ref.dtype]), err

# (tokens, experts, top_k, hidden, intermediate, routing)
SHAPES = (
    (1, 8, 2, 64, 32, "random"),  # one token: decode of a batch of one
    (0, 4, 2, 32, 32, "random"),  # an empty batch
    (7, 4, 1, 32, 48, "random"),
    (12, 3, 2, 48, 16, "random"),
    (9, 8, 3, 32, 64, "random"),
    (5, 6, 2, 32, 32, "first experts"),  # experts 0 and 1 get every token, the rest none
    (70, 2, 1, 16, 80, "random"),  # ~35 rows per expert: 64-row tiles, padded
)


def routing(tokens: int, experts: int, top_k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """topk_ids [tokens, top_k]: distinct experts per token. "random" never
    picks the last expert, so every case has an expert with no rows."""
    if kind == "first experts":
        return torch.arange(top_k).repeat(tokens, 1)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)
    for t in range(tokens):
        ids[t] = torch.randperm(experts - 1, generator=gen)[:top_k]
    return ids


def cases(device: str):
    from tandem.kernels.fused_moe_triton import fused_moe_triton

    gen = torch.Generator().manual_seed(0)
    # (activation dtype, experts: in the activation dtype, or e4m3 as W8A16 or W8A8)
    variants = [(dtype, experts) for experts in ("model dtype", "W8A16", "W8A8")
                for dtype in (torch.float32, torch.bfloat16)]
    for dtype, experts_kind in variants:
        fp8, w8a8 = experts_kind != "model dtype", experts_kind == "W8A8"
        for tokens, experts, top_k, hidden, inter, kind in SHAPES:
            x = torch.randn(tokens, hidden, generator=gen).to(dtype=dtype, device=device)
            w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype=dtype,
                                                                                             device=device)
            w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype=dtype, device=device)
            ids = routing(tokens, experts, top_k, kind, gen).to(device)
            weights = torch.rand(tokens, top_k, generator=gen)
            weights = (weights / weights.sum(-1, keepdim=True)).to(device)  # fp32, as Mixtral's router gives
            scales, fp8_args = (), {}
            if fp8:
                (w13, w13_scale), (w2, w2_scale) = quantize_stacked(w13), quantize_stacked(w2)
                scales, fp8_args = (w13_scale, w2_scale), {"fp8_activations": w8a8}
            name = (f"fused_moe {dtype}{f' fp8 experts {experts_kind}' if fp8 else ''} T={tokens} E={experts} "
                    f"k={top_k} {hidden}x{inter} {kind}")
            out = fused_moe_triton(x, w13, w2, weights, ids, *scales, **fp8_args)
            ref = fused_moe_torch(x, w13, w2, weights, ids, *scales, **fp8_args)
            if out.shape != ref.shape or out.dtype != ref.dtype:
                yield name, (False, float("inf"))
            elif tokens == 0:
                yield name, (True, 0.0)
            else:
                yield name, close(out, ref, w8a8)


# (tokens, experts, top_k, block_m): decode of one token, Qwen3-30B-A3B's
# 128 experts at top-8 from 1 to 512 tokens (the kernel's limit), Mixtral's 8
# at top-2, and more tiles than the tile-expert loop takes at once.
ALIGN_SHAPES = ((1, 8, 2, 16), (5, 6, 2, 16), (1, 128, 8, 16), (64, 128, 8, 16), (256, 128, 8, 16),
                (512, 128, 8, 32), (256, 8, 2, 64), (300, 60, 4, 16))


def alignment_cases(device: str):
    from tandem.kernels.fused_moe_triton import ALIGN_MAX_ROWS, align_by_expert, align_by_expert_torch

    gen = torch.Generator().manual_seed(1)
    for tokens, experts, top_k, block_m in ALIGN_SHAPES:
        assert tokens * top_k <= ALIGN_MAX_ROWS
        ids = routing(tokens, experts, top_k, "random", gen).to(device)
        got = align_by_expert(ids, experts, block_m)
        want = align_by_expert_torch(ids, experts, block_m)
        same = all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
        yield f"align_by_expert T={tokens} E={experts} k={top_k} block_m={block_m}", (same, 0.0 if same else 1.0)


# (tokens, experts, top_k, renormalize, weights dtype): Qwen3-30B-A3B's
# routing (bf16 weights, renormalised or not), Mixtral's (fp32 weights), more
# tokens than a program takes, and none.
ROUTE_SHAPES = ((1, 128, 8, True, torch.bfloat16), (37, 128, 8, False, torch.bfloat16),
                (5, 8, 2, True, torch.float32), (300, 60, 4, True, torch.float32), (0, 8, 2, True, torch.float32))
# The weights' allowance: fp32 softmaxes whose exponentials may differ in the
# last bits (the GPU's fast exp), then one rounding to the weights' dtype.
ROUTE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def routing_cases(device: str):
    from tandem.kernels.fused_moe_torch import route_torch
    from tandem.kernels.moe_routing_triton import route_triton

    gen = torch.Generator().manual_seed(2)
    for tokens, experts, top_k, renormalize, weights_dtype in ROUTE_SHAPES:
        # distinct logits in bf16 (steps of 0.05 over [-3, 3.4) outlast its rounding), so no tie decides a choice
        logits = torch.stack([torch.randperm(experts, generator=gen) * 0.05 - 3.0 for _ in range(tokens)]) \
            if tokens else torch.zeros(0, experts)
        logits = logits.to(device=device, dtype=torch.bfloat16)
        weights, ids = route_triton(logits, top_k, renormalize, weights_dtype)
        ref_weights, ref_ids = route_torch(logits, top_k, renormalize, weights_dtype)
        name = f"route T={tokens} E={experts} k={top_k} renormalize={renormalize} weights {weights_dtype}"
        if ids.dtype != ref_ids.dtype or weights.dtype != ref_weights.dtype or not torch.equal(ids, ref_ids):
            yield name, (False, float("inf"))
        elif tokens == 0:
            yield name, (True, 0.0)
        else:
            err = relative_error(weights, ref_weights)
            yield name, (err <= ROUTE_TOLERANCE[weights_dtype], err)


def all_cases(device: str):
    yield from cases(device)
    yield from alignment_cases(device)
    yield from routing_cases(device)


def main(argv: list[str] | None = None) -> int:
    return run_checks(all_cases, check_parser("tandem.kernels.fused_moe_check", __doc__).parse_args(argv).device)


if __name__ == "__main__":
    sys.exit(main())
