"""bench/gpu_clocks.py: nvidia-smi's samples read into a clock and power
summary (the GPU side runs in `bench latency` / `bench throughput` on a GPU),
and nothing at all where there is no GPU."""
from __future__ import annotations

import pytest
import torch

from tandem.bench.gpu_clocks import ClockSampler, parse_samples

# Lines as `nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits -lms 50`
# prints them, with values the lent H200 reported (2026-11-29), an [N/A] and a
# cut-off line.
SAMPLES = """\
1980, 1980, 397.23, 700.00
1590, 1980, 689.16, 700.00
[N/A], 1980, 650.00, 700.00
1770, 1980, 600.00, 700.00
1965, 19
"""


def test_samples_give_the_mean_clock_and_power():
    r = parse_samples(SAMPLES)
    assert r.samples == 3
    assert r.sm_mhz_mean == pytest.approx((1980 + 1590 + 1770) / 3) and r.sm_mhz_min == 1590
    assert r.sm_mhz_max_rated == 1980 and r.power_limit_w == 700
    assert r.power_w_mean == pytest.approx((397.23 + 689.16 + 600) / 3)
    assert "SM clock 1780 MHz mean, 1590 min, of 1980; power 562 W mean of 700 (3 samples)" in r.summary()


def test_no_whole_sample_is_no_reading():
    assert parse_samples("") is None
    assert parse_samples("Field \"power.limit\" is not a valid field to query.\n") is None


def test_a_cpu_device_samples_nothing():
    with ClockSampler(torch.device("cpu")) as clocks:
        pass
    assert clocks.reading is None
    if not torch.cuda.is_available():
        with ClockSampler("auto") as clocks:  # --device auto without a GPU: the CPU
            pass
        assert clocks.reading is None
