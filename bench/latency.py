"""`tandem bench latency`: decode step time against the hardware floor, and
the host's own work per engine step (schedule + input preparation + the
update step: stop rules, detokenizing, outputs).

Prompt lengths are staggered over one block (CONTEXT - block_size/2 ... CONTEXT
+ block_size/2 - 1), as in serving, where requests arrive at different times:
each step some sequences fill a block (it gets named for the prefix cache) and
some start a new one, rather than all of them in the same step every
block_size steps. Host time is wall time of those three phases of each timed
step (the engine's own StepTimes), reported as the median and the mean over
the timed steps (the mean counts those steps' extra work). With --tokenizer
the requests are detokenized as in serving; without it the update step has no
text to make.

The floor of a decode step is (weight bytes + KV bytes read) / copy bandwidth:
every weight and every cached K/V byte of the batch is read once per step
(an input embedding not tied to the LM head is not: a step reads its tokens'
rows of it). The copy bandwidth is measured in the same run (bytes read +
written). The roof beside it also bounds the GEMMs by their arithmetic:
max(weight bytes / bandwidth, 2 x parameters x batch / matmul peak) + KV
bytes / bandwidth, the matmul peak measured in the same run too. From some
batch on (about 200 sequences for bf16 on an H200) the GEMMs are bound by
arithmetic, and the memory floor is out of reach. On CUDA the SM clock and
power during each batch's steps are printed as well (bench/gpu_clocks.py): a
GPU at its power limit runs slower than its rated clock. In a
mixture-of-experts model a step reads only the experts its tokens are routed
to: the floor counts each layer's experts at the share a batch of B tokens
touches when each picks top_k of E at random, 1 - (1 - top_k/E)^B (top_k/E at
batch 1: the active parameters); dummy weights route about so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

from tandem.bench.decode_switches import add_decode_switch_flag, apply_decode_switches
from tandem.bench.gpu_clocks import ClockSampler
from tandem.bench.step_gaps import measure_step_gaps
from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "latency", help="decode step time vs the memory-bandwidth floor; host time per step",
        description="Builds the engine (dummy weights of a real architecture with --preset), fills "
                    "BATCH sequences of about CONTEXT tokens (staggered over one KV block), then "
                    "times decode steps. Prints step time (each step waited for alone), the floor "
                    "(weights + KV bytes) / measured copy bandwidth, their ratio, the period of "
                    "as many steps run back to back (what a decode loop gets, asynchronous "
                    "scheduling overlapping each step's host work with the step before) and its "
                    "ratio, the roof (the floor with the GEMMs also bounded by the measured matmul "
                    "peak: max(weight bytes / bandwidth, 2 x parameters x batch / peak) + KV bytes / "
                    "bandwidth) and the period's ratio to it, and the host time per step: "
                    "scheduling, preparing inputs and the update step (stop rules, "
                    "detokenizing), median and mean; the JSON also splits it into schedule, "
                    "prepare and update. On CUDA, also the GPU's idle time before each of as "
                    "many steps back to back (CUDA events, mean and max): the host time a step "
                    "exposes, and the mean SM clock during the batch's steps (nvidia-smi; "
                    "a GPU at its power limit runs below its rated clock). With --preset, --tokenizer attaches that tokenizer "
                    "(padded to the preset's vocabulary), so each step detokenizes as in serving.")
    p.add_argument("--preset", default=None,
                   help="dummy weights of this architecture instead of --model: llama-3-8b, llama-3-tiny, "
                        "qwen3-0.6b")
    p.add_argument("--batch-sizes", default="1,8,64,256",
                   help="comma-separated (default 1,8,64,256); the largest is the engine's --max-num-seqs")
    p.add_argument("--context", type=int, default=512,
                   help="mean prompt tokens per sequence (default 512)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    p.add_argument("--kernel-profile", type=int, default=0, metavar="TOP",
                   help="CUDA only: after the timed steps at each batch size, run --steps more back to back "
                        "under torch.profiler and print the TOP kernels by GPU time a step, with the time "
                        "between kernels (default 0: off)")
    p.add_argument("--output-json", default=None)
    add_decode_switch_flag(p)
    EngineArgs.add_cli_args(p, skip=("max_num_seqs", *KV_TRANSFER_FIELDS))
    p.set_defaults(handler=run)


def build_llm(args: argparse.Namespace, max_num_seqs: int, folder: str):
    """The engine under test: the preset's dummy weights (with --tokenizer, a
    copy of that tokenizer padded to the preset's vocabulary, written into
    `folder`), or --model."""
    from tandem.bench.presets import save_preset, with_preset
    from tandem.engine import LLM

    engine_args = EngineArgs.from_cli_args(args, max_num_seqs=max_num_seqs)
    if args.preset and engine_args.tokenizer:
        save_preset(args.preset, folder, engine_args.tokenizer)
        engine_args = dataclasses.replace(engine_args, tokenizer=os.path.join(folder, "tokenizer"))
    return LLM.from_engine_args(with_preset(engine_args, args.preset))


def weight_split(model) -> tuple[int, int, int, int]:
    """(weight bytes a step reads, of which experts' bytes, top_k, experts per
    layer); no experts: (bytes, 0, 0, 0). An untied input embedding's table
    is left out (unread_embedding)."""
    from tandem.bench.roofline import unread_embedding
    from tandem.engine.models.moe import SparseMoeBlock

    total = sum(p.numel() * p.element_size() for p in model.parameters()) - unread_embedding(model)[0]
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return total, 0, 0, 0
    experts = sum(p.numel() * p.element_size() for b in blocks for p in b.experts.parameters())
    return total, experts, blocks[0].moe.top_k, blocks[0].moe.num_experts


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.roofline import copy_bandwidth, gemm_flops, matmul_peak_flops
    from tandem.engine import SamplingParams
    from tandem.kernels import compile_log

    batches = [int(b) for b in args.batch_sizes.split(",")]
    decode_kernel = apply_decode_switches(args.decode_kernel, args.tensor_parallel_size)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandem-latency-") as folder:
        llm = build_llm(args, max(batches), folder)
    start_s = time.perf_counter() - started
    compiles_at_start = compile_log.compiles()
    engine = llm.engine
    runner = engine.runner
    device = runner.device
    bw = copy_bandwidth(device)
    weight_bytes, expert_bytes, top_k, num_experts = weight_split(runner.model)
    kv_bytes_per_token = runner.layout.block_bytes // runner.block_size
    peak = matmul_peak_flops(device, runner.dtype, runner.quantization == "fp8")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    experts = (f" (experts {expert_bytes / 2**30:.2f} GiB, {top_k} of {num_experts} a token)"
               if num_experts else "")
    warmup = runner.warmup_report
    print(f"engine start {start_s:.1f} s; kernel warm-up: " + (
        f"{warmup.batches} batches in {warmup.seconds:.1f} s, "
        f"{warmup.compiled if warmup.compiled >= 0 else 'uncounted'} Triton kernels compiled"
        if warmup else "none"), file=sys.stderr)
    if args.kernel_profile and device.type != "cuda":
        print("--kernel-profile: CUDA only (torch.profiler's kernel records); no profile on "
              f"{device.type}", file=sys.stderr)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; matmul peak {peak / 1e12:.0f} TFLOP/s; "
          f"weights read a step {weight_bytes / 2**30:.2f} GiB{experts}; "
          f"KV {kv_bytes_per_token / 1024:.0f} KiB/token; tokenizer: "
          f"{'yes' if engine.tokenizer is not None else 'none (no detokenizing)'}", file=sys.stderr)
    for batch in batches:
        # timed steps alone, back to back, the step gaps', the profile's: 4 x steps and the warm-up
        params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 5, ignore_eos=True)
        lengths = [max(1, args.context + i % runner.block_size - runner.block_size // 2) for i in range(batch)]
        for i, length in enumerate(lengths):
            engine.add_request(f"b{batch}-{i}", [1000 + (i * 7 + j) % 20000 for j in range(length)], params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()  # prefill everything first
        for _ in range(2):
            engine.step()  # warm up the decode path at this batch size
        step_times, phases = [], []
        with ClockSampler(device) as clocks:
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                engine.step()
                sync()
                step_times.append(time.perf_counter() - t0)
                phases.append(dataclasses.replace(engine.step_times))
            # Then back to back, as a decode loop runs: with asynchronous scheduling
            # a step's host work overlaps the step before on the device, which the
            # waits above prevent.
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync()
            period = (time.perf_counter() - t0) / args.steps
            gaps = measure_step_gaps(engine, args.steps) if device.type == "cuda" else None
        if clocks.reading is not None:
            print(f"batch {batch}, during its steps: {clocks.reading.summary()}", file=sys.stderr)
        profile = None
        if args.kernel_profile and device.type == "cuda":
            from tandem.bench.kernel_profile import profile_steps

            profile = profile_steps(engine.step, args.steps)
            print(f"batch {batch}: kernels of {args.steps} decode steps back to back\n"
                  f"{profile.table(args.kernel_profile)}", file=sys.stderr)
        # KV read per step: the batch's cached tokens at the middle of the timed steps
        kv_tokens = sum(lengths) + batch * (2 + args.steps)
        touched = expert_bytes * (1 - (1 - top_k / num_experts) ** batch) if num_experts else 0
        weights_read = weight_bytes - expert_bytes + touched
        floor = (weights_read + kv_tokens * kv_bytes_per_token) / bw
        # The GEMMs cannot beat the matmul peak either: from some batch on
        # (about 200 rows for bf16 on an H200) their arithmetic, not their
        # weights' bytes, bounds them. Attention stays bound by its KV bytes.
        # Every row of a decode step is sampled, so each passes the LM head
        # too; where bytes bind, the roof is the floor itself.
        arithmetic = gemm_flops(runner.model, batch, batch) / peak
        roof = floor + max(0.0, arithmetic - weights_read / bw)
        step = statistics.median(step_times)
        host_times = [p.host for p in phases]
        rows.append({"batch": batch, "context": kv_tokens / batch, "step_ms": step * 1e3,
                     "floor_ms": floor * 1e3, "ratio": step / floor,
                     "period_ms": period * 1e3, "period_ratio": period / floor,
                     "roof_ms": roof * 1e3, "period_roof_ratio": period / roof,
                     "host_ms": statistics.median(host_times) * 1e3,
                     "host_mean_ms": statistics.fmean(host_times) * 1e3,
                     "schedule_ms": statistics.median(p.schedule for p in phases) * 1e3,
                     "prepare_ms": statistics.median(p.prepare for p in phases) * 1e3,
                     "update_ms": statistics.median(p.update for p in phases) * 1e3,
                     "tokens_per_s": batch / step,
                     "gpu_idle_ms": gaps.mean_ms if gaps else None,
                     "gpu_idle_max_ms": gaps.max_ms if gaps else None,
                     "clocks": dataclasses.asdict(clocks.reading) if clocks.reading else None,
                     "kernel_profile": dataclasses.asdict(profile) if profile else None})
        engine.abort(list(engine.scheduler.requests))
    print(f"asynchronous scheduling: {'on' if engine.async_scheduling else 'off'}", file=sys.stderr)
    print(f"{'batch':>6}{'step ms':>10}{'floor ms':>10}{'ratio':>8}{'period':>8}{'ratio':>7}{'roof ms':>9}"
          f"{'ratio':>7}{'host ms':>9}{'(mean)':>8}{'sched':>8}{'prep':>8}{'update':>8}{'tok/s':>10}"
          f"{'GPU idle':>10}{'(max)':>8}{'MHz':>6}")
    for r in rows:
        idle = (f"{r['gpu_idle_ms']:>10.3f}{r['gpu_idle_max_ms']:>8.3f}" if r["gpu_idle_ms"] is not None
                else f"{'-':>10}{'-':>8}")
        mhz = f"{r['clocks']['sm_mhz_mean']:>6.0f}" if r["clocks"] else f"{'-':>6}"
        print(f"{r['batch']:>6}{r['step_ms']:>10.2f}{r['floor_ms']:>10.2f}{r['ratio']:>8.2f}{r['period_ms']:>8.2f}"
              f"{r['period_ratio']:>7.2f}{r['roof_ms']:>9.2f}{r['period_roof_ratio']:>7.2f}{r['host_ms']:>9.3f}"
              f"{r['host_mean_ms']:>8.3f}{r['schedule_ms']:>8.3f}{r['prepare_ms']:>8.3f}{r['update_ms']:>8.3f}"
              f"{r['tokens_per_s']:>10.0f}{idle}{mhz}")
    compiled_after_start = compile_log.compiles() - compiles_at_start
    print(f"Triton kernels compiled after the engine started: {compiled_after_start}", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "copy_bandwidth_Bps": bw, "matmul_peak_flops": peak, "weight_bytes": weight_bytes, "expert_bytes": expert_bytes, "cuda_graphs": runner.graphs is not None,
                       "tokenizer": engine.tokenizer is not None, "async_scheduling": engine.async_scheduling,
                       "start_s": start_s, "warmup": dataclasses.asdict(warmup) if warmup else None,
                       "compiled_after_start": compiled_after_start, "decode_kernel": decode_kernel,
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
