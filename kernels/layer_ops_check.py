"""Check the per-layer Triton kernels (layer_ops_triton.py) against their
torch twins: RMSNorm with and without the residual add, per-head RMSNorm on
a strided view, rotary embedding on views of a fused QKV output,
SiLU-and-multiply, and the GEMVs of one-row, two-row and few-row linear layers (gemv_triton.py)
against torch's linear; fp32, bf16 and fp16; power-of-two and other widths.

    TRITON_INTERPRET=1 python -m tandem.kernels.layer_ops_check --device cpu   # CI, no GPU
    python -m tandem.kernels.layer_ops_check --device cuda                     # on a GPU

Exit status 0 when every case agrees; the last line says how many were checked.
"""
from __future__ import annotations

import sys

import torch

from tandem.kernels.check_runner import check_parser, relative_error, run_checks
from tandem.kernels.layer_ops_torch import rms_norm_torch, rotary_torch, silu_and_mul_torch

# Agreement relative to the largest magnitude of the reference: a rounding step of the dtype
# (summation order differs). bf16 gets two: Triton's interpreter converts fp32 to bf16 by
# truncation where the GPU (and torch) round to nearest, so on the CPU every rounding point can
# land one step lower. A wrong kernel is off by far more.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -10}


def close(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    err = relative_error(out, ref)
    return err <= TOLERANCE[ref.dtype], err


def cases(device: str):
    from tandem.kernels import gemv_triton
    from tandem.kernels.gemv_triton import FEW_ROWS_TILE, gemv, gemv_pair, gemv_rows
    from tandem.kernels.layer_ops_triton import rms_norm_triton, rotary_triton, silu_and_mul_triton

    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, hidden in ((1, 64), (5, 96), (17, 256)):
            x, w = rand(tokens, hidden, dtype=dtype), rand(hidden, dtype=dtype)
            yield f"rms_norm {dtype} {tokens}x{hidden}", close(rms_norm_triton(x, w, 1e-6)[0],
                                                               rms_norm_torch(x, w, 1e-6)[0])
            res = rand(tokens, hidden, dtype=dtype)
            ref_out, ref_res = rms_norm_torch(x, w, 1e-6, res.clone())
            mine = res.clone()
            out, mine = rms_norm_triton(x, w, 1e-6, mine)
            ok_out, e1 = close(out, ref_out)
            ok_res, e2 = close(mine, ref_res)
            yield f"add+rms_norm {dtype} {tokens}x{hidden}", (ok_out and ok_res, max(e1, e2))
        for tokens, num_q, num_k, head_dim in ((1, 4, 2, 16), (7, 8, 2, 64), (3, 6, 3, 80), (9, 4, 4, 128)):
            # q and k as views of one fused qkv row, the way the model hands them over
            qkv = rand(tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype)
            q = qkv[:, :num_q * head_dim].view(tokens, num_q, head_dim)
            k = qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
            w = rand(head_dim, dtype=dtype)
            yield f"per-head rms_norm {dtype} {tokens}x{num_q}x{head_dim}", close(
                rms_norm_triton(q, w, 1e-6)[0], rms_norm_torch(q, w, 1e-6)[0])
            angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6.3
            emb = torch.cat((angles, angles), dim=-1)
            cos, sin = emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)
            ref_q, ref_k = rotary_torch(q, k, cos, sin)
            out_q, out_k = rotary_triton(q.clone(), k.clone(), cos, sin)
            (ok_q, e1), (ok_k, e2) = close(out_q, ref_q), close(out_k, ref_k)
            yield f"rotary {dtype} {tokens}x{num_q}/{num_k}x{head_dim}", (ok_q and ok_k, max(e1, e2))
        for tokens, inter in ((1, 128), (6, 352), (3, 2048)):
            gate_up = rand(tokens, 2 * inter, dtype=dtype)
            yield f"silu_and_mul {dtype} {tokens}x{inter}", close(silu_and_mul_triton(gate_up),
                                                                  silu_and_mul_torch(gate_up))
        # The GEMV of a one-row linear layer (kernels.ops.linear), at widths that are not multiples of its tiles
        for rows, k, n, has_bias in ((1, 96, 40, False), (1, 1100, 72, True), (2, 64, 24, True)):
            x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype)
            b = rand(n, dtype=dtype) if has_bias else None
            yield (f"gemv {dtype} {rows}x{k} times {n}x{k}{' + bias' if has_bias else ''}",
                   close(gemv(x, w, b), torch.nn.functional.linear(x, w, b)))
        # The few-row kernel: one row, a verifying step's 5, a full tile of 16; widths off its tiles
        for rows, k, n, has_bias in ((1, 96, 40, False), (5, 300, 72, True), (FEW_ROWS_TILE, 1100, 33, True),
                                     (2, 64, 24, False)):
            x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype)
            b = rand(n, dtype=dtype) if has_bias else None
            yield (f"gemv_rows {dtype} {rows}x{k} times {n}x{k}{' + bias' if has_bias else ''}",
                   close(gemv_rows(x, w, b), torch.nn.functional.linear(x, w, b)))
        # Two rows a program: a pair, one row, a pair and a half (the last row masked); widths off
        # its tiles, and the default tiles of a long row (gemv_pair_tiles)
        for rows, k, n, has_bias, tiles in ((2, 96, 40, False, (8, 64, 2)), (1, 1100, 72, True, (4, 256, 3)),
                                            (3, 300, 33, True, (16, 128, 3)), (2, 4100, 20, False, (None,) * 3)):
            x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype)
            b = rand(n, dtype=dtype) if has_bias else None
            yield (f"gemv_pair {dtype} {rows}x{k} times {n}x{k}{' + bias' if has_bias else ''}",
                   close(gemv_pair(x, w, b, *tiles), torch.nn.functional.linear(x, w, b)))
        # more channel tiles than a grid takes (gemv_triton.MAX_CHANNEL_TILES): launched slice by slice
        x, w, b = rand(1, 64, dtype=dtype), rand(100, 64, dtype=dtype), rand(100, dtype=dtype)
        limit, gemv_triton.MAX_CHANNEL_TILES = gemv_triton.MAX_CHANNEL_TILES, 3
        try:
            sliced = gemv(x, w, b)
        finally:
            gemv_triton.MAX_CHANNEL_TILES = limit
        yield (f"gemv {dtype} 1x64 times 100x64 + bias, launched in slices of 3 tiles",
               close(sliced, torch.nn.functional.linear(x, w, b)))


def main(argv: list[str] | None = None) -> int:
    return run_checks(cases, check_parser("tandem.kernels.layer_ops_check", __doc__).parse_args(argv).device)


if __name__ == "__main__":
    sys.exit(main())
