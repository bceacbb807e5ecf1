"""Where the host time of a steady decode step goes: `schedule()` and the
statements of `ModelRunner._prepare_decodes`, each timed on its own right
after a real engine step (as `tandem bench latency` times them together).

    python -m tandem.bench.host_probe --preset llama-3-8b --batch-sizes 1,256

Prints, per batch size, the median microseconds of each piece. `schedule
again` runs schedule() a second time on the same state: the difference to
the first is the work of requests that take a new block (and name the full
one) plus the cost of caches gone cold during the step. The pieces replay the
decode path's statements, so they must follow that method when it changes;
`prepare() whole` is the method itself, for comparison (it runs after the
pieces, on warmer caches).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from tandem.bench.presets import PRESET_DECIDES, with_preset
from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def probe(engine, batch: int, steps: int) -> dict[str, float]:
    """Median seconds of each piece over `steps` decode steps at this batch size."""
    import numpy as np
    import torch

    from tandem.engine import SamplingParams

    runner = engine.runner
    dev = runner.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    bs = runner.block_size
    params = SamplingParams(temperature=0, max_tokens=steps + 5, ignore_eos=True)
    for i in range(batch):  # prompts staggered over one block, as in bench latency
        length = max(1, 512 + i % bs - bs // 2)
        engine.add_request(f"probe{batch}-{i}", [1000 + (i * 7 + j) % 20000 for j in range(length)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(2):
        engine.step()
    times: dict[str, list[float]] = {}
    clock = time.perf_counter

    def timed(name: str, fn):
        start = clock()
        value = fn()
        times.setdefault(name, []).append(clock() - start)
        return value

    def to_dev(a):
        return torch.from_numpy(a).to(dev, non_blocking=True)

    for _ in range(steps):
        sync()
        plan = timed("schedule", engine.scheduler.schedule)
        sch = plan.scheduled
        n = len(sch)
        tables = timed("block tables", lambda: runner.block_tables.update([s.block_ids for s in sch]))
        positions = timed("positions", lambda: np.array([s.start for s in sch], dtype=np.int64))
        ids = timed("token ids", lambda: np.array([s.request.all_token_ids[-1] for s in sch], dtype=np.int64))
        slots = timed("slots", lambda: tables[runner._arange[:n], positions // bs].astype(np.int64) * bs
                      + positions % bs)
        seq_lens = timed("seq_lens", lambda: (positions + 1).astype(np.int32))
        timed("copy 1 (slots)", lambda: to_dev(slots))
        timed("copy 2 (seq_lens)", lambda: to_dev(seq_lens))
        timed("copy 3 (block tables)", lambda: to_dev(tables))
        timed("copy 4 (token ids)", lambda: to_dev(ids))
        timed("copy 5 (positions)", lambda: to_dev(positions))
        timed("max_seq_len", lambda: int(seq_lens.max()))
        timed("device slice", lambda: runner._dev_arange32[: n + 1])
        if dev.type == "cuda":
            timed("event create + record", lambda: torch.cuda.Event().record())
        sync()
        for s in sch:  # undo the probe's progress: the same plan again, then the real step
            s.request.num_computed_tokens = s.start
        plan = timed("schedule again", engine.scheduler.schedule)
        timed("prepare() whole", lambda: runner.prepare(plan))
        for s in sch:
            s.request.num_computed_tokens = s.start
        engine.step()
    engine.abort(list(engine.scheduler.requests))
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.host_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b", help="dummy weights of this architecture")
    parser.add_argument("--batch-sizes", default="1,256",
                        help="comma-separated (default 1,256); the largest is the engine's --max-num-seqs")
    parser.add_argument("--steps", type=int, default=25, help="decode steps timed per batch size")
    EngineArgs.add_cli_args(parser, skip=(*PRESET_DECIDES, "max_num_seqs", *KV_TRANSFER_FIELDS))
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")

    from tandem.engine import LLM

    engine_args = EngineArgs.from_cli_args(args, max_num_seqs=max(batches))
    llm = LLM.from_engine_args(with_preset(engine_args, args.preset))
    for batch in batches:
        medians = probe(llm.engine, batch, args.steps)
        print(f"batch {batch}: " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in medians.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
