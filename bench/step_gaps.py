"""How long the GPU waits for the host between engine steps run back to back.

Under asynchronous scheduling step N+1 is scheduled, prepared and launched
while step N runs on the device, so the device should go from one step's
work straight to the next one's. Where the host is late, the device idles
in between: that is the host time a step exposes (issue 20 asks for under
0.2 ms at batch 256).

Measured with CUDA events on the engine's stream, no profiler: one recorded
after each `engine.step()` returns (it completes when everything that step
queued, its sampling included, has run), one recorded just before each
step's forward (after its inputs' copies were queued). The idle time before
step N+1 is the time from the first event of step N to the second of step
N+1: zero where the forward's event was queued while the device was still
busy, else how long the device had nothing to do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class StepGaps:
    steps: int
    idle_ms: list[float]  # before each step but the first

    @property
    def mean_ms(self) -> float:
        return sum(self.idle_ms) / len(self.idle_ms) if self.idle_ms else 0.0

    @property
    def max_ms(self) -> float:
        return max(self.idle_ms, default=0.0)


def measure_step_gaps(engine, steps: int, before_step: Optional[Callable[[], None]] = None) -> StepGaps:
    """Runs engine.step() `steps` times back to back (CUDA only) and returns the
    device's idle time before each step's forward. before_step, if given, runs
    on the host before each step (a test injects a delay with it)."""
    import torch

    runner = engine.runner
    if runner.device.type != "cuda":
        raise ValueError("step gaps are measured with CUDA events: a CUDA engine only")
    forward = runner.forward
    forward_starts: list[torch.cuda.Event] = []
    step_ends: list[torch.cuda.Event] = []

    def timed_forward(*args, **kwargs):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        forward_starts.append(event)
        return forward(*args, **kwargs)

    runner.forward = timed_forward  # an instance attribute: shadows the method until deleted
    try:
        for _ in range(steps):
            if before_step is not None:
                before_step()
            engine.step()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            step_ends.append(event)
    finally:
        del runner.forward
    torch.cuda.synchronize()
    if len(forward_starts) != steps:  # a step without a forward (nothing scheduled) would misalign them
        raise RuntimeError(f"{steps} steps ran {len(forward_starts)} forwards: every step must run one")
    idle = [max(0.0, end.elapsed_time(start)) for end, start in zip(step_ends[:-1], forward_starts[1:])]
    return StepGaps(steps, idle)
