"""Run the suite as two pytest processes at once: the engine and unit tests in
one, the end-to-end stacks in the other (`make test`; `python -m tests.lanes
--help`).

Why two: on a 2-core machine one pytest process keeps the CPUs about 60%
busy, because an end-to-end test spends much of its time waiting on the
processes of its stack (starting, streaming, being killed). The unit tests
are the opposite: one process computing. Side by side they fill the gaps.
Two lanes rather than pytest-xdist's workers: xdist hands any test to any
worker, so two workers could each hold an engine-heavy unit module and a
stack at once, which does not fit in 24 GiB (docs/benchmarks.md, "CI time");
a lane holds at most one of each kind. One unit file runs in the e2e lane
(MOVED_TO_E2E), to even the lanes' times.

Tests marked `solo` (a measurement that needs a spare core) are left out of
the lanes and run after them, alone (tests/conftest.py reads LANE_ENV).

Each lane's lines are printed as they come, prefixed with its name; the exit
status is the first failing run's, else 0. Arguments naming test files or
folders run one plain pytest process with them instead.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Lane:
    name: str
    paths: tuple[str, ...]
    ignore: tuple[str, ...] = ()  # files under paths that another lane runs


# The embedded model's bf16 agreement with HF (one test, 205 s of the unit
# lane's 2042 in a --durations=0 run on dev, the e2e lane 1718 s) runs in the
# e2e lane, after its stack modules: it holds SmolLM2 twice (HF's and one
# engine, a few GiB), beside at most the session's shared stack.
MOVED_TO_E2E = ("tests/unit/test_bf16_agreement.py",)
LANES = (Lane("e2e", ("tests/e2e", *MOVED_TO_E2E)),
         Lane("unit", ("tests/unit", "tests/gpu"), ignore=MOVED_TO_E2E))
SOLO = Lane("solo", ("tests/unit", "tests/gpu", "tests/e2e"))
LANE_ENV = "TANDEM_TEST_LANE"  # tests/conftest.py: "shared" leaves solo tests out, "solo" runs only them
# Side by side, the lanes' processes (a pytest computing, a stack's engines)
# ask for more torch threads than there are cores. OpenMP's default has an
# idle thread spin before it sleeps, taking the core another process needs;
# passive threads sleep at once. On dev, the unit lane's async-scheduling
# tests beside an e2e load test: 77-80 s spinning, 59-68 s passive, two runs
# each (docs/benchmarks.md, the fourteenth session). A value already set wins.
SHARED_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
NO_TESTS_COLLECTED = 5  # pytest's exit status when a run selects nothing
_stopped: list[int] = []  # the signal that stopped the lanes, if one did


def names_tests(arg: str) -> bool:
    """Whether a pytest argument selects tests by path (tests/x.py::name)."""
    return not arg.startswith("-") and os.path.exists(os.path.join(ROOT, arg.split("::")[0]))


def _forward(lane: Lane, width: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{lane.name:>{width}}] {line}")
            sys.stdout.flush()


def run_lanes(lanes: tuple[Lane, ...], pytest_args: list[str], lane_env: str = "",
              extra_env: dict[str, str] | None = None) -> int:
    """The lanes' pytest processes at once; lane_env: LANE_ENV's value for them;
    extra_env: variables they get unless the environment already sets them."""
    lock = threading.Lock()
    width = max(len(lane.name) for lane in lanes)
    procs: list[tuple[Lane, subprocess.Popen, threading.Thread, float]] = []
    for lane in lanes:
        # Unbuffered: into a pipe, a lane's progress would come in 8 KiB bursts, minutes apart.
        ignored = [f"--ignore={path}" for path in lane.ignore]
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *lane.paths, *ignored, *pytest_args], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**(extra_env or {}), **os.environ, "PYTHONUNBUFFERED": "1",
                                     LANE_ENV: lane_env})
        reader = threading.Thread(target=_forward, args=(lane, width, proc.stdout, lock), daemon=True)
        reader.start()
        procs.append((lane, proc, reader, time.monotonic()))

    def stop(signum, _frame):  # Ctrl-C or a CI timeout: both lanes stop, not one
        _stopped.append(signum)
        for _, proc, _, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    ended: dict[int, float] = {}  # each lane's own end, whichever ends first
    while len(ended) < len(procs):
        for i, (_, proc, _, _) in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.2)
    for i, (lane, proc, reader, started) in enumerate(procs):
        reader.join()
        print(f"lane {lane.name} ({' '.join(lane.paths)}): exit {proc.returncode}, {ended[i] - started:.0f} s",
              flush=True)
    return next((proc.returncode for _, proc, _, _ in procs if proc.returncode != 0), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.lanes",
        description="Run the test suite as two pytest processes at once (" +
                    "; ".join(f"{l.name}: {' '.join(l.paths)}" for l in LANES) +
                    "), then the tests marked solo alone. Any other arguments go to every pytest "
                    "process; if one names a test file or folder, a single pytest process runs them "
                    "instead.")
    _, rest = parser.parse_known_args(argv)
    if any(names_tests(a) for a in rest):
        return subprocess.call([sys.executable, "-m", "pytest", *rest], cwd=ROOT)
    shared = run_lanes(LANES, rest, lane_env="shared", extra_env=SHARED_ENV)
    if _stopped:
        return shared or 1
    solo = run_lanes((SOLO,), rest, lane_env="solo")
    return shared or (0 if solo == NO_TESTS_COLLECTED else solo)


if __name__ == "__main__":
    sys.exit(main())
