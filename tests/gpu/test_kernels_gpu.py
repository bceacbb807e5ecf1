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


def test_one_row_16bit_linear_takes_the_gemv_and_other_rows_cublas(monkeypatch) -> None:
    """kernels.ops.linear: a single bf16/fp16 row goes through the Triton
    GEMV; two rows, an fp32 row, a weight of non-contiguous rows, the
    torch backend and TANDEM_GEMV=0 go to torch's linear; every answer
    agrees with torch's."""
    from tandem.kernels import gemv_triton, ops

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", counted)
    w = torch.randn(72, 1100, device="cuda")
    b = torch.randn(72, device="cuda")
    for dtype, rows, taken in ((torch.bfloat16, 1, True), (torch.float16, 1, True), (torch.bfloat16, 2, False),
                               (torch.float32, 1, False)):
        calls.clear()
        x = torch.randn(rows, 1100, device="cuda", dtype=dtype)
        out = ops.linear(x, w.to(dtype), b.to(dtype))
        ref = torch.nn.functional.linear(x.float(), w.to(dtype).float(), b.to(dtype).float())
        assert bool(calls) == taken, (dtype, rows, calls)
        assert out.dtype == dtype and out.shape == (rows, 72)
        assert (out.float() - ref).abs().max() <= 2 ** -6 * ref.abs().max()
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
    ops.linear(torch.randn(1, 1100, device="cuda", dtype=torch.bfloat16), w.bfloat16())
    assert not calls
