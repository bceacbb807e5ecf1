"""The Triton paged-attention kernels agree with their torch twins on CUDA, at full sizes.

Contexts 1..4k, batches up to 256, GQA ratios 1/3/4, head dims 64/128, block
sizes 16/32, bf16/fp16/fp32, decode-only and mixed batches (each mixed one
also with its new tokens' K/V read through tensor descriptors, on Hopper),
and the decode path replayed from a CUDA graph after its lengths and tables
changed.
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 would run the kernels on the CPU"),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_kernels_match_torch_twins_on_gpu(seed: int, capsys) -> None:
    from tandem.kernels.selfcheck import run

    status = run("full", seed, "cuda", verbose=True)
    report = capsys.readouterr().out
    assert status == 0, report
    assert " 0 failed" in report, report


def test_layer_op_kernels_match_torch_twins_on_gpu() -> None:
    from tandem.kernels.layer_ops_check import cases

    failed = [(name, err) for name, (ok, err) in cases("cuda") if not ok]
    assert not failed, failed


def test_few_16bit_rows_take_the_gemv_kernels_and_other_rows_cublas(monkeypatch) -> None:
    """kernels.ops.linear: a single bf16/fp16 row goes through the Triton
    GEMV, 2-16 rows through the few-row kernel, 2 rows of a large weight
    through gemv_pair; 17 rows, an fp32 row, a vocabulary-wide weight over
    short rows, a large weight at 3-16 rows or as wide as PAIR_MAX_N at 2,
    a weight of non-contiguous rows, the torch backend and TANDEM_GEMV=0 go
    to torch's linear; every answer agrees with torch's."""
    from tandem.kernels import gemv_triton, ops

    calls = []

    def counted(*args, **kwargs):
        calls.append(("gemv", args[0].shape))
        return real(*args, **kwargs)

    def counted_rows(*args, **kwargs):
        calls.append(("rows", args[0].shape))
        return real_rows(*args, **kwargs)

    def counted_pair(*args, **kwargs):
        calls.append(("pair", args[0].shape))
        return real_pair(*args, **kwargs)

    real, real_rows, real_pair = gemv_triton.gemv, gemv_triton.gemv_rows, gemv_triton.gemv_pair
    monkeypatch.setattr(gemv_triton, "gemv_rows", counted_rows)
    monkeypatch.setattr(gemv_triton, "gemv_pair", counted_pair)
    monkeypatch.setattr(gemv_triton, "gemv", counted)
    w = torch.randn(72, 1100, device="cuda")
    b = torch.randn(72, device="cuda")
    for dtype, rows, taken in ((torch.bfloat16, 1, "gemv"), (torch.float16, 1, "gemv"), (torch.bfloat16, 2, "rows"),
                               (torch.float16, 5, "rows"), (torch.bfloat16, 16, "rows"), (torch.bfloat16, 17, None),
                               (torch.float32, 1, None)):
        calls.clear()
        x = torch.randn(rows, 1100, device="cuda", dtype=dtype)
        out = ops.linear(x, w.to(dtype), b.to(dtype))
        ref = torch.nn.functional.linear(x.float(), w.to(dtype).float(), b.to(dtype).float())
        assert [c[0] for c in calls] == ([taken] if taken else []), (dtype, rows, calls)
        assert out.dtype == dtype and out.shape == (rows, 72)
        assert (out.float() - ref).abs().max() <= 2 ** -6 * ref.abs().max()
    # rows of a 3-d input count together (a [batch, tokens, K] activation)
    calls.clear()
    x3 = torch.randn(2, 3, 1100, device="cuda", dtype=torch.bfloat16)
    assert ops.linear(x3, w.bfloat16()).shape == (2, 3, 72) and calls == [("rows", (6, 1100))]
    # a vocabulary-wide weight over short rows stays with cuBLAS at any row count, and so do
    # weights of more than FEW_ROWS_MAX_WEIGHT elements at 3-16 rows (one row: the GEMV; two: gemv_pair)
    calls.clear()
    head = torch.randn(ops.WIDE_N, 64, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 5):
        out = ops.linear(torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16), head)
        assert out.shape == (rows, ops.WIDE_N)
    assert not calls
    big = torch.empty(ops.FEW_ROWS_MAX_WEIGHT // 4096 + 8, 4096, device="cuda", dtype=torch.bfloat16).normal_()
    assert big.shape[0] < ops.WIDE_N
    ops.linear(torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16), big)
    assert not calls
    ops.linear(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), big)
    assert [c[0] for c in calls] == ["gemv"]
    calls.clear()
    x2 = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    out = ops.linear(x2, big)
    ref = torch.nn.functional.linear(x2.float(), big.float())
    assert calls == [("pair", (2, 4096))] and (out.float() - ref).abs().max() <= 2 ** -6 * ref.abs().max()
    calls.clear()
    wide = torch.empty(ops.PAIR_MAX_N, 1024, device="cuda", dtype=torch.bfloat16).normal_()
    assert wide.numel() > ops.FEW_ROWS_MAX_WEIGHT
    ops.linear(torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16), wide)
    assert not calls
    # a weight whose rows are not contiguous (a transposed view) stays with torch
    calls.clear()
    w_t = w.bfloat16().t().contiguous().t()
    x = torch.randn(1, 1100, device="cuda", dtype=torch.bfloat16)
    assert torch.allclose(ops.linear(x, w_t), torch.nn.functional.linear(x, w_t)) and not calls
    monkeypatch.setattr(ops, "_backend", "torch")
    ops.linear(torch.randn(1, 1100, device="cuda", dtype=torch.bfloat16), w.bfloat16())
    assert not calls
    monkeypatch.setattr(ops, "_backend", "auto")
    monkeypatch.setattr(ops, "_gemv_on", False)  # TANDEM_GEMV=0
    for rows in (1, 5):
        ops.linear(torch.randn(rows, 1100, device="cuda", dtype=torch.bfloat16), w.bfloat16())
    assert not calls
