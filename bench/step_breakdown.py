"""Where an offline run's time goes, by the path each engine step took
(ModelRunner.last_path: decode graphs, verifying graphs, piecewise graphs,
eager), each path's time beside the compute roofline of its tokens.

Why: `bench throughput` gives one fraction of the roofline for the whole
run; this says which steps hold the rest. The recorder notes when each
engine.step() call returns and which forward it launched. A call waits for
the step it reads the tokens of: its own without asynchronous scheduling,
the one launched by the call before with it (the engine's _step). So the
time between two returns belongs to that step. While the GPU is the
bottleneck this is the step's GPU time; a gap the host leaves counts with
the step after it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from tandem.engine.model_runner import FORWARD_PATHS

NO_STEP = "none waited for"  # calls that waited for no step (asynchronous: the first of a run)


@dataclass
class PathShare:
    path: str
    steps: int
    tokens: int
    seconds: float
    roofline_seconds: float  # the tokens' arithmetic (2 x parameters each) at the matmul peak

    @property
    def of_roofline(self) -> float:
        return self.roofline_seconds / self.seconds if self.seconds else 0.0


@dataclass
class StepCall:
    returned: float  # perf_counter() at the return of engine.step()
    launched: Optional[tuple[str, int]]  # (path, tokens) of the forward the call launched, if any


def attribute(calls: list[StepCall], started: float, asynchronous: bool) -> dict[str, list[float]]:
    """{path: [tokens, seconds, steps]} from the calls in order. Call k's
    interval (the previous return to its own) goes to the forward call k
    launched, or under asynchronous scheduling to the one call k - 1 did."""
    totals = {path: [0.0, 0.0, 0] for path in (*FORWARD_PATHS, NO_STEP)}
    previous_return, previous_launch = started, None
    for call in calls:
        owner = previous_launch if asynchronous else call.launched
        path, tokens = owner if owner is not None else (NO_STEP, 0)
        entry = totals[path]
        entry[0] += tokens
        entry[1] += call.returned - previous_return
        entry[2] += owner is not None
        previous_return, previous_launch = call.returned, call.launched
    return totals


class StepRecorder:
    """Records every engine.step() call of `engine` between __enter__ and
    __exit__ (it wraps the instance's step and its runner's forward)."""

    def __init__(self, engine) -> None:
        self.engine, self.runner = engine, engine.runner
        self.calls: list[StepCall] = []
        self.started = 0.0
        self._launched: Optional[tuple[str, int]] = None

    def __enter__(self) -> "StepRecorder":
        step, forward = self.engine.step, self.runner.forward

        def recorded_forward(batch, *args, **kwargs):
            out = forward(batch, *args, **kwargs)
            self._launched = (self.runner.last_path, int(batch.input_ids.shape[0]))
            return out

        def recorded_step():
            self._launched = None
            out = step()
            self.calls.append(StepCall(time.perf_counter(), self._launched))
            return out

        self.runner.forward, self.engine.step = recorded_forward, recorded_step
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.forward, self.engine.step  # the class's methods again

    def shares(self, flops_per_token: float, peak_flops: float) -> list[PathShare]:
        totals = attribute(self.calls, self.started, self.engine.async_scheduling)
        return [PathShare(path, int(steps), int(tokens), seconds, flops_per_token * tokens / peak_flops)
                for path, (tokens, seconds, steps) in totals.items() if steps or seconds]


def print_shares(shares: list[PathShare]) -> None:
    total = sum(s.seconds for s in shares) or 1.0
    print(f"{'path':<18}{'steps':>8}{'tokens':>11}{'seconds':>9}{'share':>7}{'roofline s':>12}{'of it':>7}")
    for s in shares:
        print(f"{s.path:<18}{s.steps:>8}{s.tokens:>11}{s.seconds:>9.2f}{s.seconds / total:>7.1%}"
              f"{s.roofline_seconds:>12.2f}{s.of_roofline:>7.2f}")
