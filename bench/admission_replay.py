"""Replay an offline workload through the real scheduler, without a model:
what each admission policy (--admission) makes the engine compute.

    python -m tandem.bench.admission_replay --kv-tokens 393744 --num-prompts 1000 \\
        --input-len 128 1024 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 16384

The workload is `tandem bench throughput`'s (the same lengths for the same
--seed); each step the plan is counted and every sampled row gets a stand-in
token, as tests/unit/test_scheduler.py drives the scheduler. It prints, per
policy, the steps (decode-only, and those with prompt chunks), the tokens
computed and how many of them were computed again after a preemption, the
mean batch of the decode-only steps, the preemptions, the deferrals and the
admissions past the projection as a short tail; reserve once for each
--admission-overcommit and --admission-tail given (default the engine's). No
time: how long each would take depends on the GPU (docs/benchmarks.md times
the engine); this says what work each policy asks of it, on any machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Optional

from tandem.engine.admission import DEFAULT_OVERCOMMIT, DEFAULT_TAIL
from tandem.engine.config import AdmissionPolicy, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler

BLOCK_SIZE = 16
VOCAB = 128256  # Llama-3's: only the token ids' range, as the throughput bench draws them
STAND_IN_TOKEN = 5


@dataclass
class ReplayResult:
    admission: str
    overcommit: Optional[float]  # reserve's; None for greedy
    tail: Optional[float]  # reserve's --admission-tail; None for greedy
    steps: int
    decode_steps: int  # steps without a prompt chunk
    tokens_computed: int
    tokens_recomputed: int  # computed beyond each request's prompt and output once
    decode_step_tokens: int
    mean_decode_batch: float
    preemptions: int
    admissions_deferred: int
    admissions_tail: int


def replay(prompt_lens: list[int], output_lens: list[int], kv_tokens: int, admission: AdmissionPolicy,
           max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 8192,
           overcommit: float = DEFAULT_OVERCOMMIT, tail: float = DEFAULT_TAIL) -> ReplayResult:
    num_blocks = kv_tokens // BLOCK_SIZE + 1  # block 0 is reserved
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      admission=admission, admission_overcommit=overcommit,
                                      admission_tail=tail),
                      KVCacheManager(num_blocks, BLOCK_SIZE), max_model_len=max_model_len)
    for i, (n_in, n_out) in enumerate(zip(prompt_lens, output_lens)):
        # Distinct token ids per request: no prompt shares a block with another.
        prompt = [1000 + (i * 7919 + j) % 29000 for j in range(n_in)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=n_out, temperature=0,
                                                                  ignore_eos=True)))
    steps = decode_steps = computed = decode_tokens = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        n = plan.num_scheduled_tokens
        steps += 1
        computed += n
        if all(k == 1 for k in plan.num_new_tokens):
            decode_steps += 1
            decode_tokens += n
        rows = len(sched.sampling_requests)
        sched.update([STAND_IN_TOKEN] * rows, [None] * rows, {})
        if steps > 1_000_000:
            raise RuntimeError("the replay does not finish: the cache is too small for a request")
    once = sum(prompt_lens) + sum(n - 1 for n in output_lens)  # the last token is sampled, never computed
    reserve = admission == "reserve"
    return ReplayResult(admission, overcommit if reserve else None, tail if reserve else None, steps, decode_steps,
                        computed, computed - once, decode_tokens,
                        decode_tokens / decode_steps if decode_steps else 0.0,
                        sched.stats.num_preemptions, sched.stats.num_admissions_deferred,
                        sched.stats.num_admissions_tail)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-tokens", type=int, required=True,
                   help="tokens the KV cache holds (an engine prints it: `tandem bench throughput`'s "
                        "'engine:' line); 393744 is Llama-3-8B's on an 80 GB H100")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, nargs=2, default=[128, 1024], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] (default 128 1024)")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request (default 256)")
    p.add_argument("--seed", type=int, default=0, help="as the throughput bench's: the same lengths (default 0)")
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--admission", action="append", choices=("reserve", "greedy"), default=None,
                   help="policies to replay (repeat; default both)")
    p.add_argument("--admission-overcommit", action="append", type=float, default=None, metavar="SHARE",
                   help="reserve's overcommit, as the engine's flag (repeat to replay reserve with each; "
                        f"default {DEFAULT_OVERCOMMIT})")
    p.add_argument("--admission-tail", action="append", type=float, default=None, metavar="SHARE",
                   help="reserve's short-tail share, as the engine's flag (repeat to replay reserve with each; "
                        f"default {DEFAULT_TAIL})")
    p.add_argument("--output-json", default=None)


def register(subparsers) -> None:
    p = subparsers.add_parser("admission-replay", help="an offline workload through the real scheduler, "
                              "without a model: the work each --admission policy asks",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tandem.bench.throughput import make_workload

    workload = argparse.Namespace(seed=args.seed, dataset="random", input_len=args.input_len,
                                  output_len=args.output_len, num_prompts=args.num_prompts)
    prompts, output_lens = make_workload(workload, VOCAB)
    prompt_lens = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, {sum(prompt_lens)} prompt tokens, {sum(output_lens)} output tokens; "
          f"KV cache {args.kv_tokens} tokens, max_num_seqs {args.max_num_seqs}, "
          f"{args.max_num_batched_tokens} tokens a step", file=sys.stderr)
    overcommits = args.admission_overcommit or [DEFAULT_OVERCOMMIT]
    tails = args.admission_tail or [DEFAULT_TAIL]
    results = [replay(prompt_lens, output_lens, args.kv_tokens, a, args.max_num_seqs, args.max_num_batched_tokens,
                      overcommit=oc, tail=t)
               for a in (args.admission or ["reserve", "greedy"])
               for oc in (overcommits if a == "reserve" else [0.0])
               for t in (tails if a == "reserve" else [0.0])]
    print("reserve's rows: overcommit / tail share", file=sys.stderr)
    print(f"{'admission':<16} {'steps':>6} {'decode':>7} {'computed':>10} {'recomputed':>11} "
          f"{'decode batch':>13} {'preemptions':>12} {'deferred':>9} {'tail':>6}")
    for r in results:
        label = r.admission if r.overcommit is None else f"{r.admission} {r.overcommit:g} / {r.tail:g}"
        print(f"{label:<16} {r.steps:>6} {r.decode_steps:>7} {r.tokens_computed:>10} "
              f"{r.tokens_recomputed:>11} {r.mean_decode_batch:>13.1f} {r.preemptions:>12} "
              f"{r.admissions_deferred:>9} {r.admissions_tail:>6}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.admission_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
