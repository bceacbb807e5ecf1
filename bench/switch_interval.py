"""What a GIL switch interval costs a thread that computes: a loop of Python
work timed beside nothing, beside a thread that wakes each millisecond for
50 us (as a KV transfer's answers do), and beside one that never sleeps (the
worst case: the GIL changes hands every interval). Engine processes with a
KV store client run ENGINE_SWITCH_INTERVAL_S (services/kvstore/mover.py).

    python -m tandem.bench.switch_interval --intervals-ms 1,0.25
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Callable, Optional

WAKER_PERIOD_S = 0.001
WAKER_WORK_S = 50e-6


def _work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


def _spinner(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def _waker(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(WAKER_PERIOD_S)
        until = time.perf_counter() + WAKER_WORK_S
        while time.perf_counter() < until:
            pass


NEIGHBOURS: dict[str, Optional[Callable[[threading.Event], None]]] = {
    "nothing": None, "waker": _waker, "spinner": _spinner}


def median_ms(interval_s: float, neighbour: str, iterations: int, repeats: int) -> float:
    """Median ms of the work loop at this interval beside `neighbour`."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    target = NEIGHBOURS[neighbour]
    thread = threading.Thread(target=target, args=(stop,), daemon=True) if target else None
    if thread:
        thread.start()
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _work(iterations)
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        if thread:
            thread.join()
    return statistics.median(times) * 1e3


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.switch_interval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals-ms", default="1,0.25", help="switch intervals to compare (comma-separated)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each measuring every interval in turn")
    parser.add_argument("--iterations", type=int, default=200_000, help="additions in one timed loop")
    parser.add_argument("--repeats", type=int, default=30, help="timed loops per measurement; the median is kept")
    args = parser.parse_args(argv)
    intervals = [float(x) / 1e3 for x in args.intervals_ms.split(",")]
    old = sys.getswitchinterval()
    try:
        print("beside     " + "".join(f"{i * 1e3:>10g} ms" for i in intervals) + "   (median ms of the loop)")
        for round_ in range(args.rounds):
            for neighbour in NEIGHBOURS:
                cells = [median_ms(i, neighbour, args.iterations, args.repeats) for i in intervals]
                print(f"{neighbour:<10} " + "".join(f"{c:>13.2f}" for c in cells) + f"   round {round_ + 1}",
                      flush=True)
    finally:
        sys.setswitchinterval(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
