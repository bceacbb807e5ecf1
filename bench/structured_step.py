"""The decode step with and without a grammar on every request, and what the
grammar's parts cost: `python -m tandem.bench.structured_step --preset qwen3-0.6b
--tokenizer DIR --batch 64`.

One engine, `--batch` requests of `--prompt-len` tokens; once every prompt is
in the cache, the median wall time of `--steps` decode steps. Each
configuration (no constraint; a JSON schema with the mask applied by
xgrammar's kernel; the same with the torch twin) runs `--rounds` times,
alternating, in one process. Then one more constrained run times the
manager's fill (bitmask, with the pending accepts), its accept and the mask's
apply (synchronised on CUDA). A GPU figure; on the CPU the forward dominates.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

from tandem.bench.throughput import LONG_JSON_SCHEMA


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.structured_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="dummy-weight model (tandem.bench.presets)")
    p.add_argument("--tokenizer", required=True, help="a HF tokenizer folder (the grammar needs one)")
    p.add_argument("--batch", type=int, default=64, help="requests decoding at once (default 64)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default 256)")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per run (default 200)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration (default 2)")
    args = p.parse_args(argv)

    import tandem.engine.grammar as grammar
    import tandem.engine.structured_output_manager as manager
    from tandem.bench.presets import with_preset
    from tandem.engine import LLM, SamplingParams, StructuredOutputs
    from tandem.engine.config import EngineArgs

    engine_args = with_preset(EngineArgs(model=args.preset, tokenizer=args.tokenizer, max_num_seqs=args.batch),
                              args.preset)
    engine = LLM.from_engine_args(engine_args).engine
    schema = StructuredOutputs(json=LONG_JSON_SCHEMA)
    parts: dict[str, list[float]] = {"fill (bitmask)": [], "accept": [], "apply": []}

    def timed(name: str, fn: Callable, sync: bool) -> Callable:
        def wrapper(*a, **k):
            if sync:
                _sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                _sync()
            parts[name].append(time.perf_counter() - t)
            return out
        return wrapper

    def run(constrained: bool, label: str) -> float:
        for i in range(args.batch):
            extra = {"structured_outputs": schema} if constrained else {"ignore_eos": True}
            engine.add_request(f"{label}-{i}", list(range(1000, 1000 + args.prompt_len)),
                               SamplingParams(temperature=0.0, max_tokens=args.steps + 50, **extra))
        while engine.structured.num_pending or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        _sync()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        _sync()
        engine.abort(list(engine.scheduler.requests))
        while engine.has_unfinished():
            engine.step()
        return statistics.median(times) * 1e3

    for rnd in range(args.rounds):
        for constrained, kernel in ((False, "-"), (True, "xgrammar"), (True, "torch")):
            grammar.MASK_KERNEL = kernel if constrained else grammar.MASK_KERNEL
            ms = run(constrained, f"r{rnd}-{kernel}")
            print(f"{args.preset} batch {args.batch}: {'JSON schema' if constrained else 'no constraint'}"
                  f"{', mask by ' + kernel if constrained else ''}: median step {ms:.2f} ms", flush=True)
    grammar.MASK_KERNEL = "xgrammar"
    originals = (manager.StructuredOutputManager.bitmask, manager.StructuredOutputManager.accept,
                 grammar.TokenMasks.apply)
    manager.StructuredOutputManager.bitmask = timed("fill (bitmask)", originals[0], sync=False)
    manager.StructuredOutputManager.accept = timed("accept", originals[1], sync=False)
    grammar.TokenMasks.apply = timed("apply", originals[2], sync=True)
    try:
        run(True, "parts")
    finally:
        (manager.StructuredOutputManager.bitmask, manager.StructuredOutputManager.accept,
         grammar.TokenMasks.apply) = originals
    for name, values in parts.items():
        print(f"  {name}: median {statistics.median(values) * 1e3:.3f} ms over {len(values)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
