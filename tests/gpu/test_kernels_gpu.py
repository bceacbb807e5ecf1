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
