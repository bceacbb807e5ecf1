"""`python -m tandem.bench.host_copy`: how fast this host copies KV-sized
blocks between resident buffers, alone and several at once: the ceiling of
every KV path that copies bytes in host memory (the store's copies in and out
of an engine's arena, the staging copies).

Each worker copies --size-mib in blocks of --block-kib between buffers it
touched beforehand (no page faults), again and again for --seconds:
- threads: ctypes.memmove in threads of this process (the GIL is released
  during each copy, and taken again between copies);
- processes: the same in separate processes (no GIL shared): what the memory
  system gives;
- preadv / pwritev: a whole piece of blocks in one system call between a file
  in /dev/shm and the buffers (the kernel copies; the GIL is released once
  per piece, not once per block).
The aggregate GB/s (bytes copied, not bytes read plus written) for each
worker count."""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import tempfile
import threading
import time
from typing import Callable

SHM_DIR = "/dev/shm"


def _buffers(count: int, size: int) -> list[bytearray]:
    out = [bytearray(size) for _ in range(count)]
    for b in out:
        b[:] = b"\x01" * size  # resident before timing
    return out


def _address(b: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(b))


def _memmove_worker(total: int, block: int, seconds: float) -> float:
    """Bytes copied per second by one worker."""
    n = max(1, total // block)
    src, dst = _buffers(n, block), _buffers(n, block)
    pairs = [(_address(d), _address(s)) for d, s in zip(dst, src)]
    copied, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for d, s in pairs:
            ctypes.memmove(d, s, block)
        copied += n * block
    return copied / (time.perf_counter() - start)


def _vector_worker(total: int, block: int, seconds: float, piece: int, write: bool) -> float:
    """Bytes per second moved between a /dev/shm file and buffers, `piece` blocks per call."""
    n = max(1, total // block)
    with tempfile.NamedTemporaryFile(dir=SHM_DIR if os.path.isdir(SHM_DIR) else None) as f:
        f.write(b"\x01" * (n * block))
        f.flush()
        buffers = _buffers(n, block)
        fd = f.fileno()
        copied, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for first in range(0, n, piece):
                views = buffers[first:first + piece]
                if write:
                    os.pwritev(fd, views, first * block)
                else:
                    os.preadv(fd, views, first * block)
            copied += n * block
        return copied / (time.perf_counter() - start)


def _in_threads(count: int, fn: Callable[[], float]) -> float:
    rates: list[float] = []
    lock = threading.Lock()

    def run() -> None:
        rate = fn()
        with lock:
            rates.append(rate)
    threads = [threading.Thread(target=run) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(rates)


def _proc_entry(args: tuple, out) -> None:
    out.put(_memmove_worker(*args))


def _in_processes(count: int, args: tuple) -> float:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_proc_entry, args=(args, out)) for _ in range(count)]
    for p in procs:
        p.start()
    rates = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.host_copy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts, comma-separated")
    parser.add_argument("--size-mib", type=int, default=256, help="bytes each worker copies per pass")
    parser.add_argument("--block-kib", type=int, default=2048, help="one copy's bytes (default: a Llama-3-8B block)")
    parser.add_argument("--piece-blocks", type=int, default=32, help="blocks per preadv/pwritev call")
    parser.add_argument("--seconds", type=float, default=2.0, help="each measurement's length")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    total, block = args.size_mib << 20, args.block_kib << 10
    rows = []
    print(f"{'workers':>8}{'threads':>10}{'processes':>11}{'preadv':>9}{'pwritev':>9}  GB/s copied, all workers")
    for count in [int(w) for w in args.workers.split(",")]:
        row = {
            "workers": count,
            "threads": _in_threads(count, lambda: _memmove_worker(total, block, args.seconds)) / 1e9,
            "processes": _in_processes(count, (total, block, args.seconds)) / 1e9,
            "preadv": _in_threads(count, lambda: _vector_worker(total, block, args.seconds,
                                                                 args.piece_blocks, False)) / 1e9,
            "pwritev": _in_threads(count, lambda: _vector_worker(total, block, args.seconds,
                                                                  args.piece_blocks, True)) / 1e9,
        }
        rows.append(row)
        print(f"{count:>8}{row['threads']:>10.2f}{row['processes']:>11.2f}{row['preadv']:>9.2f}"
              f"{row['pwritev']:>9.2f}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"block_bytes": block, "size_bytes": total, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
