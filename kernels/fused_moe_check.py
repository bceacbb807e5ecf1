"""Check the fused-MoE Triton kernels (fused_moe_triton.py) against their torch
twin: several expert counts, top-k 1 and 2 (and 3: a sum of more than two),
an expert that gets no row, one expert that gets every row, a single token
and none; fp32 and bf16; widths that are not powers of two; and each of these
with FP8 experts (e4m3 weights, a scale per expert and output channel).

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
# measures. bf16 gets twice layer_ops_check's allowance: a row is rounded six
# times in a chain (gate, up, SiLU, SiLU * up, down, the weighted output), and
# Triton's interpreter rounds each by truncation where torch rounds to
# nearest; with truncation emulated in torch the kernel agrees to one rounding
# of the final sum. A wrong expert or a missing weight is off by far more.
MOE_TOLERANCE = {**TOLERANCE, torch.bfloat16: 2 ** -5}


def close(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    err = relative_error(out, ref)
    return err <= MOE_TOLERANCE[ref.dtype], err

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
    for dtype, fp8 in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                       (torch.bfloat16, True)):
        for tokens, experts, top_k, hidden, inter, kind in SHAPES:
            x = torch.randn(tokens, hidden, generator=gen).to(dtype=dtype, device=device)
            w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype=dtype,
                                                                                             device=device)
            w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype=dtype, device=device)
            ids = routing(tokens, experts, top_k, kind, gen).to(device)
            weights = torch.rand(tokens, top_k, generator=gen)
            weights = (weights / weights.sum(-1, keepdim=True)).to(device)  # fp32, as Mixtral's router gives
            scales = ()
            if fp8:
                (w13, w13_scale), (w2, w2_scale) = quantize_stacked(w13), quantize_stacked(w2)
                scales = (w13_scale, w2_scale)
            name = (f"fused_moe {dtype}{' fp8 experts' if fp8 else ''} T={tokens} E={experts} k={top_k} "
                    f"{hidden}x{inter} {kind}")
            out = fused_moe_triton(x, w13, w2, weights, ids, *scales)
            ref = fused_moe_torch(x, w13, w2, weights, ids, *scales)
            if out.shape != ref.shape or out.dtype != ref.dtype:
                yield name, (False, float("inf"))
            elif tokens == 0:
                yield name, (True, 0.0)
            else:
                yield name, close(out, ref)


def main(argv: list[str] | None = None) -> int:
    return run_checks(cases, check_parser("tandem.kernels.fused_moe_check", __doc__).parse_args(argv).device)


if __name__ == "__main__":
    sys.exit(main())
