"""`tandem bench mixed-steps`: steps that carry a prompt chunk beside a batch
of decodes, run through the piecewise CUDA graphs (engine/piecewise_graphs.py)
and eagerly, in one process.

BATCH sequences of about CONTEXT tokens decode while a long prompt is
prefilled CHUNK tokens a step (the scheduler's long_prefill_token_threshold),
as in serving when a request arrives during decoding. For each (batch, chunk)
the steps are timed with the runner's piecewise graphs and with them set
aside, alternating ROUNDS times; each time STEPS steps waited for alone
(step), then as many back to back (period: asynchronous scheduling overlaps a
step's host work with the step before), and the median host time of the
forward call (launching the layers; the device runs behind it). Steps of more
than the graphs' largest bucket (piecewise_graphs.MAX_TOKENS tokens) run
eagerly either way. On a CPU there are no graphs: only the eager rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from typing import Iterator, Optional

from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def register(subparsers) -> None:
    p = subparsers.add_parser("mixed-steps", help="prompt chunks beside decodes: piecewise CUDA graphs vs eager",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(handler=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="dummy weights of a real architecture (bench/presets.py)")
    p.add_argument("--batch-sizes", default="8,64", help="decoding sequences, comma-separated (default 8,64)")
    p.add_argument("--chunks", default="16,64,256", help="prompt tokens a step, comma-separated (default 16,64,256)")
    p.add_argument("--context", type=int, default=512, help="the decoding sequences' prompt length (default 512)")
    p.add_argument("--steps", type=int, default=20, help="steps timed per setting and round (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="times each setting is timed, alternating (default 2)")
    p.add_argument("--output-json", default=None)
    # --chunks sets the prompt chunk (the long-prefill threshold) of each measurement.
    EngineArgs.add_cli_args(p, skip=("max_num_seqs", "long_prefill_token_threshold", *KV_TRANSFER_FIELDS))


@dataclasses.dataclass
class Timing:
    steps: list = dataclasses.field(default_factory=list)  # each step waited for alone, s
    periods: list = dataclasses.field(default_factory=list)  # a round's steps back to back, s a step
    forwards: list = dataclasses.field(default_factory=list)  # host time of each step's forward call, s
    replays: int = 0  # steps that went through the piecewise graphs

    def row(self) -> dict:
        return {"step_ms": statistics.median(self.steps) * 1e3, "period_ms": statistics.median(self.periods) * 1e3,
                "forward_host_ms": statistics.median(self.forwards) * 1e3, "piecewise_steps": self.replays}


def prompt_length(chunk: int, steps: int) -> int:
    """Tokens of each timed prompt: two steps to join and warm up, `steps`
    timed, one to spare, so that it is still in prefill when it is aborted."""
    return chunk * (steps + 3)


def time_chunked_steps(engine, chunk: int, steps: int, prompt_id: str, first_tokens: Iterator[int], sync,
                       timing: Optional[Timing] = None) -> Timing:
    """STEPS steps alone, then STEPS back to back, each carrying `chunk` tokens
    of a fresh prompt (one for each half, aborted after it) beside the running
    decodes. The times are added to `timing` (a new one if None), which is
    returned."""
    from tandem.engine import SamplingParams

    runner = engine.runner
    vocab = runner.model.config.vocab_size
    timing = timing if timing is not None else Timing()
    replays_before = runner.piecewise.replays if runner.piecewise is not None else 0
    for half in ("alone", "back-to-back"):
        # Stride 3 from a new first token: no prefix-cache hit, on the decodes' prompts (stride 1) either.
        first = next(first_tokens)
        prompt = [(first + 3 * j) % vocab for j in range(prompt_length(chunk, steps))]
        request_id = f"{prompt_id}-{half}"
        engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1))
        for _ in range(2):
            engine.step()  # the prompt joins; the path warms up
        sync()
        if half == "alone":
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                sync()
                timing.steps.append(time.perf_counter() - t0)
                timing.forwards.append(engine.step_times.forward)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            timing.periods.append((time.perf_counter() - t0) / steps)
        # Progress advances as steps are scheduled: a chunk a step unless part of the prompt was cached.
        request = engine.scheduler.requests.get(request_id)  # None: its whole prompt was done already
        computed = request.num_computed_tokens if request is not None else len(prompt)
        if computed != chunk * (steps + 2):
            raise RuntimeError(f"the prompt advanced {computed} tokens in {steps + 2} steps, not "
                               f"{chunk * (steps + 2)}: its steps did not each carry a {chunk}-token chunk")
        engine.abort(request_id)
    if runner.piecewise is not None:
        timing.replays += runner.piecewise.replays - replays_before
    return timing


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem.bench.latency import build_llm
    from tandem.engine import SamplingParams

    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(prefix="tandem-mixed-") as folder:
        llm = build_llm(args, max(batches) + 1, folder)  # the decodes and the prompt
    engine, runner = llm.engine, llm.engine.runner
    budget = engine.scheduler.config.max_num_batched_tokens
    if max(batches) + max(chunks) > budget:
        print(f"error: a step of {max(batches)} decodes and a {max(chunks)}-token chunk exceeds the token "
              f"budget ({budget}); give --max-num-batched-tokens {max(batches) + max(chunks)} or more",
              file=sys.stderr)
        return 2
    if prompt_length(max(chunks), args.steps) > engine.max_model_len:
        print(f"error: {args.steps} timed steps of a {max(chunks)}-token chunk need prompts of "
              f"{prompt_length(max(chunks), args.steps)} tokens, past the model's context ({engine.max_model_len}); "
              f"give fewer --steps or smaller --chunks", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    graphs = runner.piecewise
    modes = ("piecewise", "eager") if graphs is not None else ("eager",)
    if graphs is None:
        print("no piecewise CUDA graphs on this engine (CUDA only, not under --enforce-eager): eager rows only",
              file=sys.stderr)
    rows = []
    vocab = runner.model.config.vocab_size
    first_tokens = itertools.count(1000, 7)
    for batch in batches:
        # Decodes that last through every round of every chunk.
        params = SamplingParams(temperature=0, max_tokens=len(chunks) * args.rounds * len(modes)
                                * (2 * args.steps + 4) + 8, ignore_eos=True)
        for i in range(batch):
            length = max(1, args.context + i % runner.block_size - runner.block_size // 2)
            engine.add_request(f"d{batch}-{i}", [(1000 + i * 7 + j) % vocab for j in range(length)], params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()  # prefill the decoding batch first
        for chunk in chunks:
            engine.scheduler.config.long_prefill_token_threshold = chunk
            timings = {mode: Timing() for mode in modes}
            for round_ in range(args.rounds):
                for mode in (modes if round_ % 2 == 0 else modes[::-1]):
                    runner.piecewise = graphs if mode == "piecewise" else None
                    time_chunked_steps(engine, chunk, args.steps, f"p{batch}-{chunk}-{round_}-{mode}",
                                       first_tokens, sync, timings[mode])
            runner.piecewise = graphs
            row = {"batch": batch, "chunk": chunk, "tokens_per_step": batch + chunk}
            for mode, t in timings.items():
                row[mode] = t.row()
            rows.append(row)
        engine.abort(list(engine.scheduler.requests))
    print_table(rows, modes)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": str(runner.device),
                       "gpu": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu",
                       "piecewise_sizes": graphs.sizes if graphs is not None else None,
                       "rows": rows}, f, indent=2)
    return 0


def print_table(rows: list[dict], modes: tuple[str, ...]) -> None:
    header = f"{'batch':>6}{'chunk':>7}{'tokens':>8}"
    for mode in modes:
        header += f"{mode + ' step':>17}{'period':>9}{'fwd host':>10}"
    if len(modes) == 2:
        header += f"{'speed-up':>10}"
    print(header + "   (ms)")
    for r in rows:
        line = f"{r['batch']:>6}{r['chunk']:>7}{r['tokens_per_step']:>8}"
        for mode in modes:
            m = r[mode]
            line += f"{m['step_ms']:>17.2f}{m['period_ms']:>9.2f}{m['forward_host_ms']:>10.2f}"
        if len(modes) == 2:
            line += f"{r['eager']['period_ms'] / r['piecewise']['period_ms']:>9.2f}x"
        print(line)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m tandem.bench.mixed_steps ...`: the same as `tandem bench mixed-steps ...`."""
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.mixed_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
