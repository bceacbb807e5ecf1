"""Where a decode step's GPU time goes: the kernels of a few engine steps
under torch.profiler (CUPTI records the kernels a CUDA graph replays one by
one), summed per kernel name and divided by the steps.

Why beside `bench latency`'s step and floor: a step above its floor is either
kernels that move bytes slower than the copy bandwidth, or time between
kernels (launch gaps, host waits). The table shows the first per kernel; the
busy time against the span from the first kernel's start to the last one's
end shows the second. A kernel launched with programmatic dependent launch
(kernels/common_triton.py) starts before the one it follows has ended and
waits on the GPU: its time includes that wait, so the per-kernel sums then
exceed the busy time (the table says so), while busy and between-kernel
times stay right.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable


@dataclasses.dataclass
class KernelShare:
    name: str
    calls_per_step: float
    us_per_step: float


@dataclasses.dataclass
class StepProfile:
    steps: int
    kernels: list[KernelShare]  # longest first
    busy_us_per_step: float  # the union of the kernels' intervals
    span_us_per_step: float  # first kernel start to last kernel end, over all steps
    # The mean of the `steps` longest idle gaps: back to back, each step
    # boundary where the GPU waits for the host's next step has one, so this
    # is the host time a step exposes (an upper bound: launch gaps count too).
    longest_gap_us_per_step: float = 0.0

    def table(self, top: int) -> str:
        lines = [f"{'us/step':>9}{'share':>7}{'calls':>7}  kernel"]
        total = sum(k.us_per_step for k in self.kernels) or 1.0
        for k in self.kernels[:top]:
            lines.append(f"{k.us_per_step:>9.1f}{k.us_per_step / total:>7.1%}{k.calls_per_step:>7.1f}  {k.name[:90]}")
        rest = self.kernels[top:]
        if rest:
            lines.append(f"{sum(k.us_per_step for k in rest):>9.1f}{'':>7}{sum(k.calls_per_step for k in rest):>7.1f}"
                         f"  ({len(rest)} other kernels)")
        lines.append(f"kernels busy {self.busy_us_per_step / 1e3:.3f} ms of a {self.span_us_per_step / 1e3:.3f} ms "
                     f"span a step (between kernels: {(self.span_us_per_step - self.busy_us_per_step) / 1e3:.3f} ms; "
                     f"the longest gap a step: {self.longest_gap_us_per_step / 1e3:.3f} ms)")
        if total > 1.05 * self.busy_us_per_step:
            lines.append(f"the kernels' times sum to {total / 1e3:.3f} ms a step, more than busy: they overlap "
                         "(a dependent launch waits for the kernel before inside its own time)")
        return "\n".join(lines)


def _busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Length of the union of [start, end) intervals, and the idle gaps
    between its pieces."""
    busy, end_so_far, gaps = 0.0, float("-inf"), []
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        if start > end_so_far > float("-inf"):
            gaps.append(start - end_so_far)
        busy += end - max(start, end_so_far)
        end_so_far = end
    return busy, gaps


def profile_steps(step: Callable[[], None], steps: int) -> StepProfile:
    """Runs step() `steps` times back to back under the profiler (CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    intervals = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        # Copies and memsets count as GPU work as kernels do
        start, end = evt.time_range.start, evt.time_range.end
        per_name[evt.name].append(end - start)
        intervals.append((start, end))
    kernels = sorted((KernelShare(name, len(d) / steps, sum(d) / steps) for name, d in per_name.items()),
                     key=lambda k: -k.us_per_step)
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    busy, gaps = _busy_and_gaps(intervals)
    longest = sorted(gaps, reverse=True)[:steps]
    return StepProfile(steps, kernels, busy / steps, span / steps, sum(longest) / steps)
