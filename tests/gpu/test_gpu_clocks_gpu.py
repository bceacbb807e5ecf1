"""bench/gpu_clocks.py and the sustained matmul rate on a GPU: nvidia-smi's
samples arrive while the GPU works, and the rate of matmuls run back to back
is no higher than the best single one's (power limits only lower it)."""
from __future__ import annotations

import shutil
import time

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")]


def test_samples_arrive_while_the_gpu_works_and_sustained_is_not_above_burst():
    from tandem.bench.gpu_clocks import ClockSampler
    from tandem.bench.roofline import matmul_peak_flops, sustained_matmul_flops

    device = torch.device("cuda")
    with ClockSampler(device) as clocks:
        burst = matmul_peak_flops(device, torch.bfloat16)
        sustained = sustained_matmul_flops(device, torch.bfloat16, seconds=2.0)
        time.sleep(0.2)
    r = clocks.reading
    assert r is not None and r.samples >= 10, r
    assert 0 < r.sm_mhz_min <= r.sm_mhz_mean <= r.sm_mhz_max_rated
    assert 0 < r.power_w_mean and 0 < r.power_limit_w
    assert 0.3 * burst < sustained <= 1.03 * burst, (burst, sustained)
    print(f"burst {burst / 1e12:.0f} TFLOP/s, sustained {sustained / 1e12:.0f}; {r.summary()}")
