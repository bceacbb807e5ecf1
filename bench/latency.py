"""`tandem bench latency`: decode step time against the hardware floor, and
the CPU time of one engine step (schedule + input preparation).

Prompt lengths are staggered over one block (CONTEXT - block_size/2 ... CONTEXT
+ block_size/2 - 1), as in serving, where requests arrive at different times:
each step some sequences fill a block (it gets named for the prefix cache) and
some start a new one, rather than all of them in the same step every
block_size steps. Host time is wall time, reported as the median and the mean
over the timed steps (the mean counts those steps' extra work), beside the
median CPU time of the same interval (the thread's CPU clock), which leaves
out time the thread spent descheduled by a busy or shared host.

The floor of a decode step is (weight bytes + KV bytes read) / copy bandwidth:
every weight and every cached K/V byte of the batch is read once per step.
The copy bandwidth is measured in the same run (bytes read + written).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "latency", help="decode step time vs the memory-bandwidth floor; CPU time per step",
        description="Builds the engine (dummy weights of a real architecture with --preset), fills "
                    "BATCH sequences of about CONTEXT tokens (staggered over one KV block), then "
                    "times decode steps. Prints step time, the floor (weights + KV bytes) / "
                    "measured copy bandwidth, their ratio, and the host time spent scheduling "
                    "and preparing inputs per step: wall time (median and mean) and the "
                    "thread's CPU time (median); the JSON also splits the wall time into "
                    "schedule and prepare.")
    p.add_argument("--preset", default=None,
                   help="dummy weights of this architecture instead of --model: llama-3-8b, qwen3-0.6b")
    p.add_argument("--batch-sizes", default="1,8,64,256",
                   help="comma-separated (default 1,8,64,256); the largest is the engine's --max-num-seqs")
    p.add_argument("--context", type=int, default=512,
                   help="mean prompt tokens per sequence (default 512)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p, skip=("max_num_seqs", *KV_TRANSFER_FIELDS))
    p.set_defaults(handler=run)


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy, counting read + write."""
    import torch

    if device.type != "cuda":
        src = torch.empty(64 * 2**20, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        return 2 * src.numel() * 10 / (time.perf_counter() - start)
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start_ev.record()
        dst.copy_(src)
        end_ev.record()
        torch.cuda.synchronize()
        times.append(start_ev.elapsed_time(end_ev) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 / statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine import LLM, SamplingParams

    from tandem.bench.presets import with_preset

    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = EngineArgs.from_cli_args(args, max_num_seqs=max(batches))
    llm = LLM.from_engine_args(with_preset(engine_args, args.preset))
    engine = llm.engine
    runner = engine.runner
    device = runner.device
    bw = copy_bandwidth(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes_per_token = runner.block_bytes // runner.block_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; weights {weight_bytes / 2**30:.2f} GiB; "
          f"KV {kv_bytes_per_token / 1024:.0f} KiB/token", file=sys.stderr)
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=args.steps + 5, ignore_eos=True)
        lengths = [max(1, args.context + i % runner.block_size - runner.block_size // 2) for i in range(batch)]
        for i, length in enumerate(lengths):
            engine.add_request(f"b{batch}-{i}", [1000 + (i * 7 + j) % 20000 for j in range(length)], params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()  # prefill everything first
        for _ in range(2):
            engine.step()  # warm up the decode path at this batch size
        step_times, schedule_times, prepare_times, cpu_times = [], [], [], []
        for _ in range(args.steps):
            sync()
            c0, t0 = time.thread_time(), time.perf_counter()
            plan = engine.scheduler.schedule()
            t1 = time.perf_counter()
            runner.prepare(plan)
            t2, c2 = time.perf_counter(), time.thread_time()
            schedule_times.append(t1 - t0)
            prepare_times.append(t2 - t1)
            cpu_times.append(c2 - c0)
            # undo the probe: schedule() advanced progress; the timed step below redoes it
            for s in plan.scheduled:
                s.request.num_computed_tokens = s.start
            sync()
            t1 = time.perf_counter()
            engine.step()
            sync()
            step_times.append(time.perf_counter() - t1)
        # KV read per step: the batch's cached tokens at the middle of the timed steps
        kv_tokens = sum(lengths) + batch * (2 + args.steps // 2)
        floor = (weight_bytes + kv_tokens * kv_bytes_per_token) / bw
        step = statistics.median(step_times)
        host_times = [a + b for a, b in zip(schedule_times, prepare_times)]
        rows.append({"batch": batch, "context": kv_tokens / batch, "step_ms": step * 1e3,
                     "floor_ms": floor * 1e3, "ratio": step / floor,
                     "host_ms": statistics.median(host_times) * 1e3,
                     "host_mean_ms": statistics.fmean(host_times) * 1e3,
                     "host_cpu_ms": statistics.median(cpu_times) * 1e3,
                     "schedule_ms": statistics.median(schedule_times) * 1e3,
                     "prepare_ms": statistics.median(prepare_times) * 1e3,
                     "tokens_per_s": batch / step})
        engine.abort(list(engine.scheduler.requests))
    print(f"{'batch':>6}{'step ms':>10}{'floor ms':>10}{'ratio':>8}{'host ms':>9}{'(mean)':>8}{'(cpu)':>8}"
          f"{'tok/s':>10}")
    for r in rows:
        print(f"{r['batch']:>6}{r['step_ms']:>10.2f}{r['floor_ms']:>10.2f}{r['ratio']:>8.2f}"
              f"{r['host_ms']:>9.3f}{r['host_mean_ms']:>8.3f}{r['host_cpu_ms']:>8.3f}{r['tokens_per_s']:>10.0f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "copy_bandwidth_Bps": bw, "weight_bytes": weight_bytes, "cuda_graphs": runner.graphs is not None,
                       "rows": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.bench.latency ...`: the same as `tandem bench latency ...`."""
    parser = argparse.ArgumentParser(prog="tandem bench")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["latency", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
