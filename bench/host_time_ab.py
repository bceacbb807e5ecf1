"""Host work of a steady decode step, this tree against the engine before the
plan-as-data change (22ef933), on one workload: `tandem bench latency`'s
(prompts staggered over one block around --context, prefilled, 2 warm-up
steps, then --steps timed steps), with a tokenizer attached so the update
step detokenizes. One process measures one side; alternate them.

host = schedule + prepare + update:
- new: the engine's own StepTimes;
- old: its step() replayed here with clocks between the same phases
  (schedule() and the per-entry prompt-token counting that followed it, which
  the new code does inside schedule(); runner.prepare(); the loop of
  _append_and_check over the sampled requests). The model and the sampler
  run as in the old execute() and are not counted.

The old side runs a checkout of 22ef933 mapped onto the tandem.* import
tree ahead of the installed one (docs/benchmarks.md has the commands):

    PYTHONPATH=/tmp/pkg_old python -m tandem.bench.host_time_ab --which old --preset llama-3-8b \
        --tokenizer DIR --batch 256
    python -m tandem.bench.host_time_ab --which new --preset llama-3-8b --tokenizer DIR --batch 256
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def build(args, package: str = "tandem"):
    import importlib

    presets = importlib.import_module(f"{package}.bench.presets")
    engine = importlib.import_module(f"{package}.engine")
    folder = tempfile.mkdtemp(prefix="host-ab-")
    presets.save_preset(args.preset, folder, args.tokenizer)
    extra = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    return engine.LLM(folder, load_format="dummy", hf_config=presets.preset_config(args.preset),
                      tokenizer=os.path.join(folder, "tokenizer"), max_num_seqs=args.batch, device=args.device,
                      **extra)


def fill(engine, args, params) -> None:
    """The batch: prompts staggered over one block around --context, prefilled, 2 warm-up steps."""
    bs = engine.config.cache.block_size
    for i in range(args.batch):
        length = max(1, args.context + i % bs - bs // 2)
        engine.add_request(f"b{i}", [1000 + (i * 7 + j) % 20000 for j in range(length)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(2):
        engine.step()


def new_step(engine, phases: list) -> None:
    engine.step()
    t = engine.step_times
    phases.append((t.schedule, t.prepare, t.update))


def row(which: str, code: str, batch: int, phases: list) -> dict:
    host = [sum(p) for p in phases]
    return {"which": which, "code": code, "batch": batch, "host_ms": statistics.median(host) * 1e3,
            "host_mean_ms": statistics.fmean(host) * 1e3,
            "schedule_ms": statistics.median(p[0] for p in phases) * 1e3,
            "prepare_ms": statistics.median(p[1] for p in phases) * 1e3,
            "update_ms": statistics.median(p[2] for p in phases) * 1e3}


def old_step(engine, phases: list) -> list:
    import torch

    clock = time.perf_counter
    ready, engine._ready = engine._ready, []
    t0 = clock()
    plan = engine.scheduler.schedule()
    engine.last_step_empty = plan.is_empty and not ready
    if plan.is_empty:
        return ready
    for s in plan.scheduled:
        engine._count_prompt_tokens(s)
    t1 = clock()
    runner = engine.runner
    batch = runner.prepare(plan)
    t2 = clock()
    with torch.inference_mode():
        if (runner.graphs is not None and batch.meta.is_decode_only
                and runner.graphs.bucket(len(plan.scheduled)) is not None):
            hidden = runner.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta, None)
        rows = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        logits = runner.model.compute_logits(rows)
        result = runner.sampler(logits, [s.request for s in batch.sampling])
    t3 = clock()
    now = time.monotonic()
    outputs = ready
    for i, (s, token, logprob) in enumerate(zip(batch.sampling, result.token_ids, result.logprobs)):
        error = result.errors.get(i)
        if error is None:
            outputs.append(engine._append_and_check(s.request, token, logprob, now))
        else:
            outputs.append(engine._fail(s.request, error))
    t4 = clock()
    phases.append((t1 - t0, t2 - t1, t4 - t3))
    return outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.host_time_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=["old", "new", "both"], required=True)
    p.add_argument("--old-root", default=None, help="--which both: the folder holding package tandem_old")
    p.add_argument("--preset", default="llama-3-tiny")
    p.add_argument("--tokenizer", default="smollm2")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per engine (two engines share the GPU with --which both)")
    p.add_argument("--json", default=None)
    p.add_argument("--thrash-mib", type=int, default=0,
                   help="touch this many MiB before each timed step (cold caches, as after a GPU step)")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from tandem.engine import SamplingParams

    sides = {}  # name -> (engine, step function, its phases)
    if args.which in ("old", "both"):
        if args.which == "both":
            sys.path.insert(0, args.old_root)
        package = "tandem_old" if args.which == "both" else "tandem"
        engine = build(args, package).engine
        sides["old"] = (engine, old_step, [])
    if args.which in ("new", "both"):
        sides["new"] = (build(args).engine, new_step, [])
    for engine, _, _ in sides.values():
        fill(engine, args, SamplingParams(temperature=0, max_tokens=args.steps + 5, ignore_eos=True))
    dev = torch.device(next(iter(sides.values()))[0].config.resolved_device())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    junk = np.ones(args.thrash_mib * 2**20 // 8) if args.thrash_mib else None
    for _ in range(args.steps):
        for engine, step, phases in sides.values():  # both: one step of each, in turn
            if junk is not None:
                junk += 1.0
            sync()
            step(engine, phases)
            sync()
    rows = []
    for name, (engine, _, phases) in sides.items():
        code = os.path.dirname(os.path.dirname(sys.modules[type(engine).__module__].__file__))
        rows.append(row(name, code, args.batch, phases))
    for r in rows:
        print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
