"""One long prompt through the engine, step by step: how long each prefill
chunk takes and how much memory the process peaks at. The chunk is the
longest an abort or a client disconnect waits before the prompt stops
computing, and the peak is what a prompt at the context limit costs.

    python -m tandem.bench.long_prompt --tokens 8000 --budget 2048
    python -m tandem.bench.long_prompt --tokens 8000 --budget 8192 --query-tile 0

--query-tile 0 turns off the torch attention's query tiling (one attention
call over the whole chunk, as before 2026-11-25). Prints one JSON line.
Peak RSS is the process's high-water mark, so compare settings in separate
processes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def run(engine_args: EngineArgs, tokens: int, budget: int, query_tile: int) -> dict:
    from tandem.engine import LLM, SamplingParams
    from tandem.kernels import paged_attention_torch

    if query_tile == 0:
        query_tile = 1 << 30
    paged_attention_torch.QUERY_TILE = query_tile
    llm = LLM.from_engine_args(dataclasses.replace(engine_args, max_num_batched_tokens=budget))
    engine = llm.engine
    prompt = [(i * 7919) % 40000 + 100 for i in range(tokens)]  # no prefix-cache hits
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=1))
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(round(time.perf_counter() - t0, 2))
    return {"tokens": tokens, "budget": budget, "query_tile": query_tile, "step_seconds": steps,
            "total_seconds": round(sum(steps), 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8000, help="prompt length")
    parser.add_argument("--budget", type=int, default=2048,
                        help="the engine's --max-num-batched-tokens (the chunk length measured)")
    parser.add_argument("--query-tile", type=int, default=256,
                        help="queries per attention call in the torch twin; 0: no tiling")
    # It measures the torch twin on the CPU unless told otherwise.
    EngineArgs.add_cli_args(parser, skip=("max_num_batched_tokens", *KV_TRANSFER_FIELDS),
                            defaults={"device": "cpu"})
    args = parser.parse_args()
    print(json.dumps(run(EngineArgs.from_cli_args(args), args.tokens, args.budget, args.query_tile)))


if __name__ == "__main__":
    main()
