"""All-reduce check and timing across this machine's GPUs: tensor
parallelism's peer-memory one-shot path (engine/peer_all_reduce.py) against
NCCL, on the tensor sizes a decode or prefill step all-reduces.

One process per GPU, as the engine's ranks. Each size is checked first (the
peer sum against NCCL's, bf16 and fp32), then timed as the engine runs it:
ITERS all-reduces captured in one CUDA graph, the graph replayed, time per
all-reduce reported. Run with python -m tandem.bench.all_reduce.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DEFAULT_SIZES = "8K,32K,128K,512K,1M"
ITERS = 32  # all-reduces per graph: a decode step of a 16-layer model


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tandem.bench.all_reduce",
        description="Check the peer-memory all-reduce against NCCL on every visible GPU (one process "
                    "each) and time both inside CUDA graphs. Exits 1 if any sum differs.")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: every visible GPU)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"bytes per all-reduce, comma-separated, K/M suffixes (default {DEFAULT_SIZES})")
    p.add_argument("--replays", type=int, default=50, help="timed replays of each graph (default 50)")
    p.add_argument("--output-json", default=None, help="also write the table here (rank 0)")
    return p


def _time_graph(fn, x: torch.Tensor, replays: int) -> float:
    """Microseconds per all-reduce: ITERS of fn captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        y = x
        for _ in range(ITERS):
            y = fn(y) * 0.5  # each depends on the last, as layers do
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    graph.reset()
    return elapsed / replays / ITERS * 1e6


def _nccl(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def _rank_main(rank: int, world: int, init_method: str, sizes: list[int], replays: int, results) -> None:
    import torch.distributed as dist

    from tandem.engine import tensor_parallel as tp

    from tandem.engine.peer_all_reduce import PeerAllReduce

    tp.init_tp(rank, world, init_method, "cuda", peer_all_reduce=False)
    device = tp.rank_device("cuda", rank)
    # Sized for every size asked, past the engine's own threshold: where the crossover lies is the point.
    peer = PeerAllReduce.build(device, max_bytes=max(sizes))
    rows, ok = [], True
    for nbytes in sizes:
        for dtype in (torch.bfloat16, torch.float32):
            n = nbytes // torch.tensor([], dtype=dtype).element_size()
            gen = torch.Generator(device=device).manual_seed(1000 + rank)
            x = torch.randn(n, device=device, dtype=dtype, generator=gen)
            want = x.clone()
            dist.all_reduce(want)
            row = {"bytes": nbytes, "dtype": str(dtype).removeprefix("torch."), "peer": None,
                   "peer_us": None}
            if peer is not None and peer.fits(x):
                got = peer(x)
                torch.cuda.synchronize()
                # Two ranks: a + b rounds once whichever way it is summed, so the sums
                # are equal bit for bit; more ranks add in other orders.
                row["peer"] = bool(torch.equal(got, want) if world == 2 else
                                   torch.allclose(got, want, rtol=1e-2, atol=1e-2))
                ok &= row["peer"]
                row["peer_us"] = _time_graph(peer, x.clone(), replays)
            row["nccl_us"] = _time_graph(_nccl, x.clone(), replays)
            rows.append(row)
    everyone = torch.tensor([ok], dtype=torch.int32, device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)  # any rank's wrong sum fails the check
    if rank == 0:
        results.put((peer is not None, bool(everyone.item()), rows))
    torch.cuda.synchronize()
    del peer  # unmapped before the group goes
    tp.destroy_tp()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import multiprocessing as mp

    from tandem.engine.tp_workers import free_port

    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        print(f"needs two GPUs or more; {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init_method, sizes, args.replays, results))
             for r in range(world)]
    for p in procs:
        p.start()
    available, ok, rows = results.get(timeout=600)
    for p in procs:
        p.join(60)
    print(f"world {world}; peer all-reduce {'available' if available else 'UNAVAILABLE'}")
    print(f"{'bytes':>9} {'dtype':>9} {'equal':>6} {'nccl us':>8} {'peer us':>8}")
    for r in rows:
        nccl = f"{r['nccl_us']:8.1f}" if r.get("nccl_us") else f"{'-':>8}"
        peer = f"{r['peer_us']:8.1f}" if r["peer_us"] else f"{'-':>8}"
        print(f"{r['bytes']:>9} {r['dtype']:>9} {str(r['peer']):>6} {nccl} {peer}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"world_size": world, "peer_available": available, "rows": rows}, f, indent=2)
    return 0 if ok and available else 1


if __name__ == "__main__":
    sys.exit(main())
