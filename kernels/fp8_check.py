"""Check the FP8 linear layer's CUDA paths (fp8_triton.py) against the
dequantizing twin (fp8_torch.py), and on a GPU time them against bf16.

    TRITON_INTERPRET=1 python -m tandem.kernels.fp8_check --device cpu   # the Triton GEMMs, CI
    python -m tandem.kernels.fp8_check --device cuda --bench             # on a GPU (8.9+)

Cases, with and without bias, at widths that are not multiples of the
tiles: the weight-only GEMV (the layer's one row) against the twin's
weight-only product, at 1-150 rows (up to 16 on the CPU); the skinny GEMM
against the twin's quantized product; the activation quantizer; on CUDA the
FP8 GEMM (torch._scaled_mm) and the layer's own choice. Under the
interpreter the quantizer is checked on rows built so that no rounding
carries into the next power of two (e4m3_rows): there the interpreter's
fp32 -> e4m3 cast is wrong (125.1 becomes 64, not 128). --bench times the
layers of an 8B Llama (q/k/v, o, gate/up, down) at 1-256 rows:
bf16 matmul, the quantizer alone, the FP8 GEMM and, at one row, the layer's
own choice and the GEMV under a few tile choices, up to 8 rows the GEMV
at its default tiles (median of CUDA graph
replays, each reading the next of several weight copies, so that the L2
cache does not hold them).

Exit status 0 when every case agrees; the last line says how many were checked.
"""
from __future__ import annotations

import sys
from typing import Iterator

import torch

from tandem.kernels.check_runner import Case, check_parser, relative_error, run_checks
from tandem.kernels.fp8_torch import fp8_linear_torch, quantize_rows_torch, quantize_weight

# Relative to the reference's largest magnitude. Both sides sum the same
# exact products in fp32 (in other orders) and round once to the output
# dtype: bf16's half step (2^-9) with room for the order.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}
# The FP8 GEMM's own: Hopper's FP8 tensor cores keep fewer accumulator bits
# than fp32 (DeepSeek-V3's report measures about 14), measured 1.4e-2 at
# K = 256-512 on the H200.
FP8_GEMM_TOLERANCE = 2 ** -5

# (rows, in features, out features, bias)
SHAPES = ((1, 256, 96, False), (1, 200, 40, True), (3, 200, 80, True), (8, 512, 64, False), (16, 96, 40, True),
          (64, 256, 128, False), (150, 120, 72, True))
LLAMA_8B_LAYERS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))


def e4m3_rows(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 rows that quantize without a rounding carry: row i's largest
    magnitude is 448 * 2^p_i (its scale then exactly 2^p_i, p_i != 0 so a
    scale left out shows), every other entry an e4m3 value e times 2^p_i
    plus 0 to 3/8 of e's step (so the cast does round, down to e, and a
    cast left out shows). Exact in bf16 (at most 7 significant bits)."""
    e = (torch.randn(rows, k, generator=gen) * 64).clamp(-416, 416).to(torch.float8_e4m3fn).float()
    # e4m3's step above |e|: 2^(exponent - 3) for normals, 2^-9 below 2^-6
    step = torch.ldexp(torch.ones_like(e), torch.frexp(e.abs()).exponent - 4).clamp(min=2.0 ** -9)
    x = e + e.sign() * torch.randint(0, 4, e.shape, generator=gen) / 8 * step
    x[torch.arange(rows), torch.randint(0, k, (rows,), generator=gen)] = 448.0
    powers = torch.tensor([-6, -3, -1, 1, 2, 4])
    return torch.ldexp(x, powers[torch.randint(0, len(powers), (rows, 1), generator=gen)])


def cases(device: str) -> Iterator[Case]:
    from tandem.kernels.fp8_triton import fp8_linear_cuda, fp8_skinny_gemm, quantize_rows_triton
    from tandem.kernels.gemv_triton import gemv

    gen = torch.Generator().manual_seed(0)
    dtypes = (torch.bfloat16,) if device == "cuda" else (torch.float32, torch.bfloat16)
    for rows, k, n, has_bias in SHAPES:
        for dtype in dtypes:
            x = (torch.randn(rows, k, generator=gen) * 3).to(device=device, dtype=dtype)
            w = torch.randn(n, k, generator=gen).to(device)
            bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if has_bias else None
            wq, ws = quantize_weight(w)
            quantized = fp8_linear_torch(x, wq, ws, bias, weight_only=False)
            q, xs = quantize_rows_torch(x)
            shape = f"rows={rows} k={k} n={n} bias={has_bias} {str(dtype)[6:]}"
            # (result, the twin's product it must equal, tolerance)
            # on a GPU the skinny GEMM's products run on the FP8 tensor cores: the FP8 GEMM's allowance
            results = {"skinny": (fp8_skinny_gemm(q, xs, wq, ws, bias, dtype), quantized,
                                  FP8_GEMM_TOLERANCE if device == "cuda" else TOLERANCE[dtype])}
            # The layer runs the GEMV at one row (WEIGHT_ONLY_MAX_ROWS); under
            # the interpreter its grid of rows x channel tiles takes 5 s a call
            # at 64-150 rows, so there it is checked up to 16 rows.
            if device == "cuda" or rows <= 16:
                results["gemv"] = (gemv(x, wq, bias, ws),
                                   fp8_linear_torch(x, wq, ws, bias, weight_only=True), TOLERANCE[dtype])
            if device == "cuda":
                if k % 16 == 0 and n % 16 == 0:
                    results["fp8 gemm"] = (fp8_linear_cuda(x, wq, ws, bias, skinny=False), quantized,
                                           FP8_GEMM_TOLERANCE)
                # whichever path the layer picks for these rows, the FP8 GEMM's included
                results["layer"] = (fp8_linear_cuda(x, wq, ws, bias), fp8_linear_torch(x, wq, ws, bias),
                                    FP8_GEMM_TOLERANCE)
                tq, txs = quantize_rows_triton(x)
                err = relative_error(txs, xs)
                yield f"quantizer scales {shape}", (err <= TOLERANCE[dtype], err)
                # values: at most one e4m3 step apart (the last bit of a division)
                diff = (tq.float() - q.float()).abs()
                yield (f"quantizer values {shape} ({int((diff > 0).sum())} differ)",
                       (bool((diff <= q.float().abs() / 8 + 2.0 ** -9).all()), float(diff.max())))
            else:
                # carry-free rows, exact in bf16: the interpreter's cast rounds them right
                xe = e4m3_rows(rows, k, gen).to(dtype)
                (tq, txs), (eq, exs) = quantize_rows_triton(xe), quantize_rows_torch(xe)
                yield (f"quantizer {shape} (carry-free rows)",
                       (torch.equal(txs, exs) and torch.equal(tq.float(), eq.float()),
                        relative_error(tq.float() * txs, eq.float() * exs)))
            for name, (out, ref, tolerance) in results.items():
                err = relative_error(out, ref)
                yield f"{name} {shape}", (err <= tolerance, err)


# Weights cycled through copies of about this many bytes in --bench, so
# that a layer's weights come from memory, as in a step of 32 layers, and not
# from the L2 cache (50 MB on an H200: q/k/v's 25 MB of e4m3 fit whole).
BENCH_COPY_BYTES = 600 << 20


def bench() -> None:
    """Times of an 8B Llama's layers (microseconds, median of CUDA graph
    replays, as the engine runs them): bf16, the quantizer alone, the FP8
    GEMM and the skinny GEMM (each after the quantizer), and at one row the
    layer's own choice and the weight-only GEMV under a few tile choices, so
    the defaults come from numbers. Each replay reads the next of several
    copies of the weights (BENCH_COPY_BYTES), and the one-row lines end with
    the GEMV's read rate."""
    import itertools

    import triton.testing

    from tandem.kernels.fp8_triton import fp8_linear_cuda, quantize_rows_triton
    from tandem.kernels.gemv_triton import gemv

    def fp8_weight(quantized: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        """gemv's (weight, bias, weight_scale) of an e4m3 weight and its scales."""
        return quantized[0], None, quantized[1]

    def time_us(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3

    # (BLOCK_N, BLOCK_K, warps, stages) around the e4m3 default, 8 x 512 over 4 stages
    gemv_configs = [(4, 1024, 4, 3), (4, 1024, 4, 4), (8, 256, 4, 6), (8, 512, 4, 3), (8, 512, 4, 4),
                    (8, 512, 4, 5), (8, 512, 8, 4), (8, 1024, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3)]
    for name, k, n in LLAMA_8B_LAYERS:
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                   for _ in range(max(2, BENCH_COPY_BYTES // (2 * n * k)))]
        wq, ws = quantize_weight(weights[0])
        quantized = [(wq.clone(), ws.clone()) for _ in range(max(2, BENCH_COPY_BYTES // (n * k)))]
        # Each call made while a graph is captured takes the next copy.
        next_w, next_q = itertools.cycle(weights).__next__, itertools.cycle(quantized).__next__
        for rows in (1, 2, 4, 8, 64, 256):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            # the FP8 GEMM itself, after the quantizer (the layer's path above one row) at every row count
            cells = {"bf16": time_us(lambda: x @ next_w().t()), "quant": time_us(lambda: quantize_rows_triton(x)),
                     "gemm": time_us(lambda: fp8_linear_cuda(x, *next_q(), skinny=False)),
                     "skinny": time_us(lambda: fp8_linear_cuda(x, *next_q(), skinny=True))}
            if rows <= 8:  # whether the GEMV, rereading the weight per row, beats the skinny GEMM at 8 rows
                cells["gemv"] = time_us(lambda: gemv(x, *fp8_weight(next_q())))
            if rows <= 1:
                cells["layer"] = time_us(lambda: fp8_linear_cuda(x, *next_q()))
                for bn, bk, nw, ns in gemv_configs:
                    tiles = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                    cells[f"gemv{bn}x{bk}w{nw}s{ns}"] = time_us(lambda: gemv(x, *fp8_weight(next_q()), **tiles))
            best = min((v, c) for c, v in cells.items() if c not in ("bf16", "quant", "layer"))
            rate = f", the layer reads {n * k / cells['layer'] / 1e6:.2f} TB/s" if "layer" in cells else ""
            print(f"{name:<8} rows={rows:<4} " + " ".join(f"{c}={v:.1f}" for c, v in cells.items())
                  + f"  best {best[1]} {cells['bf16'] / best[0]:.2f}x bf16{rate}")


def main(argv: list[str] | None = None) -> int:
    parser = check_parser("tandem.kernels.fp8_check", __doc__)
    parser.add_argument("--bench", action="store_true", help="also time the layers of an 8B Llama (CUDA)")
    args = parser.parse_args(argv)
    status = run_checks(cases, args.device)
    if args.bench and args.device == "cuda":
        bench()
    return status


if __name__ == "__main__":
    sys.exit(main())
