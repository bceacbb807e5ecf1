"""The GPU's SM clock and power draw while a benchmark runs, sampled by
nvidia-smi in the background.

Why: a GPU under a heavy load lowers its clock to stay under its power limit
(an H200 at batch 256 of Llama-3-8B went from 1,980 to 1,590 MHz at 689 W of
700, 2026-11-29), so the same kernels take longer in a long run than in a
short one. A step time or a matmul peak means little without the clock it ran
at; this is the clock, beside them.

nvidia-smi comes with the NVIDIA driver wherever a CUDA GPU is; where it is
missing (or on a CPU) the sampler reports nothing and the benchmark runs on.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Optional

# Not the throttle-reason flags: on the H200 the "software power cap" flag was
# set in every sample at 234 W of 700 as at 687 W (2026-11-29), so it told
# nothing the clock does not.
QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit"


@dataclass
class ClockReading:
    samples: int
    sm_mhz_mean: float
    sm_mhz_min: float
    sm_mhz_max_rated: float  # the clock the GPU may boost to
    power_w_mean: float
    power_limit_w: float

    def summary(self) -> str:
        return (f"SM clock {self.sm_mhz_mean:.0f} MHz mean, {self.sm_mhz_min:.0f} min, of {self.sm_mhz_max_rated:.0f}; "
                f"power {self.power_w_mean:.0f} W mean of {self.power_limit_w:.0f} ({self.samples} samples)")


def parse_samples(text: str) -> Optional[ClockReading]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines of QUERY, one per
    sample; lines it could not fill ("[N/A]", a cut-off last line) are left
    out. None without a whole sample."""
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            rows.append(tuple(float(f) for f in fields))
        except ValueError:
            continue
    if not rows:
        return None
    n = len(rows)
    return ClockReading(
        samples=n, sm_mhz_mean=sum(r[0] for r in rows) / n, sm_mhz_min=min(r[0] for r in rows),
        sm_mhz_max_rated=max(r[1] for r in rows), power_w_mean=sum(r[2] for r in rows) / n,
        power_limit_w=max(r[3] for r in rows))


class ClockSampler:
    """`with ClockSampler(device) as clocks: ...` (a torch device, or a
    --device setting: "auto", "cuda", "cpu") samples every interval_ms
    while the block runs; clocks.reading is then the ClockReading (None on a
    CPU, without nvidia-smi, or with no sample taken)."""

    def __init__(self, device, interval_ms: int = 50) -> None:
        self.device = device
        self.interval_ms = interval_ms
        self.reading: Optional[ClockReading] = None
        self._process: Optional[subprocess.Popen] = None
        self._out = None

    def _gpu_id(self) -> Optional[str]:
        """nvidia-smi's name for the torch device: its UUID, so that
        CUDA_VISIBLE_DEVICES' renumbering does not pick another GPU."""
        import torch

        device = self.device
        if device == "auto":  # the --device setting: cuda when there is one
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type != "cuda" or shutil.which("nvidia-smi") is None:
            return None
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    def __enter__(self) -> "ClockSampler":
        gpu = self._gpu_id()
        if gpu is not None:
            self._out = tempfile.TemporaryFile(mode="w+")
            self._process = subprocess.Popen(
                ["nvidia-smi", "-i", gpu, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=self._out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        self._process.wait()
        self._out.seek(0)
        self.reading = parse_samples(self._out.read())
        self._out.close()


__all__ = ["ClockReading", "ClockSampler", "parse_samples"]
