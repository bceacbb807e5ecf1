"""`tandem bench spec-decode` (also `python -m tandem.bench.spec_decode`):
decode tokens/s with and without speculative decoding, in one process, on
an input-grounded workload: answers that quote their prompt (repeat a text,
put each sentence on its own line, correct its typos, rename a variable in
code), where prompt lookup and draft models have something to predict; or,
with --workload open, on free-form answers that quote nothing.

For each batch size (default 1 and 64) and each setting (no speculation,
then every --speculative-config given), BATCH requests run together, greedy,
up to --max-tokens each. --rounds N runs every setting N times, the
settings' order reversed in every other round so that a drift of the
machine (clocks, another tenant) does not favour one; the summary gives
each setting's median speed-up over the rounds, each round's speed-up
taken against that round's run without speculation. With several rounds
every setting's engine is built first and kept for the whole run (each
takes its share of --gpu-memory-utilization). Decode tokens/s counts the tokens after each
request's first over the time from the moment every request has its first
token to the last one's end, so prefill time is left out (with --steady:
output tokens/s while BATCH requests run, finished ones replaced, see
measure_steady); the acceptance
rate and the tokens per verifying step come from the engine's counters.
Where a decode step's time goes is printed per kind of step (verifying,
plain): the engine's own phase timers (engine/llm_engine.py StepTimes; on a
GPU `sample` is mostly the wait for the device) and how many verifying
steps replayed a CUDA graph. --profile-steps N then runs each setting's
largest batch once more under torch.profiler for N decode steps and prints
the operations' device time and host time.
With adaptive speculation (the default; "adaptive": false proposes at
every step, as vLLM does) the table also gives the share of decode steps
the governor let speculate, and each batch size's choice at the end.
The table says whether the greedy outputs equal those without speculation:
in fp32 they must; in bf16 a step that verifies k tokens computes in another
batch shape than one that decodes one, and a near tie may flip a token, as
any change of batch shape can.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs

DEFAULT_SPECS = ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}']

# Texts the answers quote (written for this benchmark).
TEXTS = [
    "The river town woke early. Fishermen pulled their boats onto the gravel, the baker opened his "
    "shutters, and the ferry sounded its horn twice before leaving for the far bank. By seven the market "
    "square was full of carts, and the smell of bread and wet rope hung over everything. Children ran "
    "between the stalls while their parents argued about the price of apples, and an old dog slept in the "
    "only patch of sun.",
    "To install the tool, download the archive for your platform and unpack it into a folder on your "
    "path. Run the command once without arguments to create the configuration file in your home "
    "directory. Edit that file to set the server address and your user name, then run the command again. "
    "If the connection fails, check that the port is open and that the clock of your machine is correct.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts of plant cells, where a green pigment called chlorophyll absorbs mostly red and blue "
    "light. The sugar feeds the plant and, through it, nearly every animal on land. The oxygen it releases "
    "over millions of years changed the air of the whole planet and made complex life possible.",
    "The committee met on Tuesday to review the budget for next year. The treasurer reported that income "
    "from membership fees had risen slightly, while the cost of renting the hall had doubled. After a long "
    "discussion the members agreed to look for a cheaper place to meet, to raise the fee for new members "
    "only, and to publish the accounts on the notice board every month.",
]
CODE = ("def average(values):\n    total = 0\n    count = 0\n    for value in values:\n        total += value\n"
        "        count += 1\n    if count == 0:\n        return 0.0\n    return total / count\n\n\n"
        "def report(rows):\n    total = sum(row.amount for row in rows)\n    for row in rows:\n"
        "        share = row.amount / total if total else 0.0\n        print(f\"{row.name}: {share:.1%}\")\n"
        "    print(f\"total: {total}\")\n")


def _typos(text: str) -> str:
    """Swap two letters in every seventh word: a text to correct."""
    words = text.split(" ")
    for i in range(3, len(words), 7):
        w = words[i]
        if len(w) > 3 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def task_prompts(n: int) -> list[str]:
    """n instructions whose answers quote their input, cycling over four tasks and the texts."""
    out = []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        task = i % 4
        if task == 0:
            out.append(f"Repeat the following text exactly, word for word.\n\n{text}")
        elif task == 1:
            out.append(f"Rewrite the following text with every sentence on its own line. Change nothing "
                       f"else.\n\n{text}")
        elif task == 2:
            out.append(f"Correct the spelling mistakes in the following text and write out the whole "
                       f"corrected text.\n\n{_typos(text)}")
        else:
            out.append(f"Rename the variable `total` to `grand_total` in this code and write out the whole "
                       f"code.\n\n{CODE}")
    return out


# Questions whose answers quote nothing (written for this benchmark): the
# traffic where speculation has least to predict, and may cost more than it saves.
OPEN_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me ten ideas for a birthday party for a friend who likes hiking.",
    "What are the advantages and disadvantages of working from home?",
    "Describe how a bicycle gear system works.",
    "Write a poem about the first snow of winter.",
    "How should a beginner start learning to cook?",
    "Compare trains and planes for a trip of five hundred kilometres.",
]


def open_prompts(n: int) -> list[str]:
    """n questions whose answers have no text to quote, cycling over OPEN_QUESTIONS."""
    return [OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)] for i in range(n)]


WORKLOADS = {"grounded": task_prompts, "open": open_prompts}


PHASES = ("schedule", "prepare", "forward", "sample", "update", "propose")


@dataclass
class StepBreakdown:
    """Sums over the decode steps of one kind (verifying or plain) of a run."""

    steps: int = 0
    wall: float = 0.0
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    walls: list = field(default_factory=list)  # each step's, for the median

    def add(self, wall: float, times) -> None:
        self.steps += 1
        self.wall += wall
        self.walls.append(wall)
        for name in PHASES:
            self.phases[name] += getattr(times, name)

    def line(self) -> str:
        if not self.steps:
            return "none"
        ms = 1e3 / self.steps
        parts = ", ".join(f"{name} {self.phases[name] * ms:.2f}" for name in PHASES)
        median = statistics.median(self.walls) * 1e3
        return f"{self.steps} steps, {self.wall * ms:.2f} ms each (median {median:.2f}): {parts}"


@dataclass
class SpecResult:
    setting: str
    batch_size: int
    output_tokens: int
    decode_tokens: int
    seconds: float  # the whole run, prefill included
    decode_seconds: float
    draft_tokens: int
    accepted_tokens: int
    drafts: int
    emitted_tokens: int
    same_as_baseline: Optional[bool]
    verifying_steps: StepBreakdown = field(default_factory=StepBreakdown)
    plain_steps: StepBreakdown = field(default_factory=StepBreakdown)
    verify_graph_replays: int = 0  # verifying steps that replayed a CUDA graph (padded or not)
    round: int = 0
    governed_speculate_steps: int = 0  # adaptive: decode steps the governor let speculate
    governed_plain_steps: int = 0
    governor_leaders: dict = field(default_factory=dict)  # batch group -> speculating, at the run's end
    # adaptive: the engine's totals so far of bursts of speculation skipped on
    # the shadow lookups' prediction, and of shadow lookups checked
    governor_skipped_bursts: int = 0
    governor_shadow_lookups: int = 0
    governor_report: list = field(default_factory=list)  # SpeculationGovernor.report() at the run's end

    @property
    def speculating_share(self) -> Optional[float]:
        """The share of governed decode steps allowed to speculate; None without a governor."""
        total = self.governed_speculate_steps + self.governed_plain_steps
        return self.governed_speculate_steps / total if total else None

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted_tokens / self.drafts if self.drafts else 1.0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "spec-decode", help="decode tokens/s with and without speculative decoding",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(handler=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated (default 1,64)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request at most (default 256)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every setting this many times, in alternating order; the summary takes medians "
                        "(default 1)")
    p.add_argument("--speculative-config", action="append", default=None, metavar="JSON",
                   help="a setting to compare with no speculation (as the engine flag); repeat for more. "
                        f"Default: {DEFAULT_SPECS[0]}")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="grounded",
                   help="grounded (default): answers that quote their prompt, where speculation has most to "
                        "predict; open: free-form answers that quote nothing, where it may cost more than it "
                        "saves")
    p.add_argument("--steady", action="store_true",
                   help="keep BATCH requests running, a finished one replaced by the next prompt "
                        f"({STEADY_WAVES} x BATCH in all), and count output tokens/s only while the batch is full "
                        "(a server's view); default: BATCH requests start together and the time runs until the "
                        "last one ends")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the instructions as plain text instead of through the model's chat template")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="after the timed runs, profile N decode steps of each setting's largest batch "
                        "(torch.profiler) and print the operations' device and host time (default 0: none)")
    p.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(p, skip=("speculative_config", "max_num_seqs", *KV_TRANSFER_FIELDS))


def _prompts(llm, n: int, chat: bool, workload: str = "grounded") -> list[list[int]]:
    texts = WORKLOADS[workload](n)
    if chat and getattr(llm.tokenizer, "chat_template", None):
        return [llm.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    return [llm.encode(t) for t in texts]


def measure(llm, prompts: list[list[int]], max_tokens: int, setting: str,
            baseline: Optional[list[list[int]]]) -> tuple[SpecResult, list[list[int]]]:
    from tandem.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = engine.stats()
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    _sync(engine)
    start = time.perf_counter()
    for rid, prompt in zip(tokens, prompts):
        engine.add_request(rid, prompt, params)
    all_started = None
    verifying, plain = StepBreakdown(), StepBreakdown()
    graphs = engine.runner.verify_graphs
    replays_before = graphs.replays if graphs is not None else 0
    while engine.has_unfinished():
        for out in _step(engine, all_started is not None, verifying, plain):
            tokens[out.request_id] += out.new_token_ids
        if all_started is None and all(tokens.values()):
            _sync(engine)
            all_started = time.perf_counter()
    _sync(engine)
    end = time.perf_counter()
    outputs = list(tokens.values())
    produced = sum(map(len, outputs))
    result = _result(engine, before, setting, len(prompts), produced, produced - len(prompts), end - start,
                     end - (all_started or end), None if baseline is None else outputs == baseline,
                     verifying, plain, replays_before)
    return result, outputs


def _step(engine, timed: bool, verifying: StepBreakdown, plain: StepBreakdown) -> list:
    """One engine step, its wall time and phases added to its kind's breakdown
    if `timed`; its outputs (a failed request fails the run)."""
    t0 = time.perf_counter()
    outs = engine.step()
    if timed:
        times = engine.step_times
        (verifying if times.draft_tokens else plain).add(time.perf_counter() - t0, times)
    for out in outs:
        if out.error is not None:
            raise out.error
    return outs


def _result(engine, before, setting: str, batch: int, produced: int, decode_tokens: int, seconds: float,
            decode_seconds: float, same: Optional[bool], verifying: StepBreakdown, plain: StepBreakdown,
            replays_before: int) -> SpecResult:
    """A run's SpecResult: the engine's counters since `before` (its stats at the run's start)."""
    after = engine.stats()
    graphs = engine.runner.verify_graphs
    result = SpecResult(
        setting, batch, produced, decode_tokens, seconds, decode_seconds,
        after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        after.spec_decode_num_drafts - before.spec_decode_num_drafts,
        after.spec_decode_num_emitted_tokens - before.spec_decode_num_emitted_tokens,
        same, verifying, plain, (graphs.replays - replays_before) if graphs is not None else 0,
        governed_speculate_steps=after.spec_decode_governed_speculate_steps
        - before.spec_decode_governed_speculate_steps,
        governed_plain_steps=after.spec_decode_governed_plain_steps - before.spec_decode_governed_plain_steps)
    governor = engine.speculator.governor if engine.speculator is not None else None
    if governor is not None:
        result.governor_leaders = governor.leaders()
        result.governor_skipped_bursts = governor.counts.skipped_bursts
        result.governor_shadow_lookups = governor.counts.shadow_lookups
        result.governor_report = governor.report()
    return result


STEADY_WAVES = 4  # --steady: BATCH x this many requests in all


def measure_steady(llm, prompts: list[list[int]], batch: int, max_tokens: int, setting: str,
                   baseline: Optional[list[list[int]]]) -> tuple[SpecResult, list[list[int]]]:
    """A server's view: `batch` requests run at once, each finished one
    replaced by the next of `prompts` (STEADY_WAVES x batch of them), and
    the output tokens per second are counted only while the batch is full:
    from the moment the first `batch` have their first token to the moment
    the last prompt is admitted. The tail of a closed batch, where a few
    slow requests run alone, does not count, nor does their order."""
    from tandem.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = engine.stats()
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    verifying, plain = StepBreakdown(), StepBreakdown()
    graphs = engine.runner.verify_graphs
    replays_before = graphs.replays if graphs is not None else 0
    _sync(engine)
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(str(i), prompts[i], params)
    admitted, window_start, window_end, counted = batch, None, None, 0
    while engine.has_unfinished():
        for out in _step(engine, window_start is not None and window_end is None, verifying, plain):
            tokens[out.request_id] += out.new_token_ids
            if window_start is not None and window_end is None:
                counted += len(out.new_token_ids)
            if out.finished and admitted < len(prompts):
                engine.add_request(str(admitted), prompts[admitted], params)
                admitted += 1
        if window_start is None and all(tokens[str(i)] for i in range(batch)):
            _sync(engine)
            window_start = time.perf_counter()
        if window_end is None and window_start is not None and admitted == len(prompts):
            _sync(engine)
            window_end = time.perf_counter()
    _sync(engine)
    end = time.perf_counter()
    outputs = list(tokens.values())
    window_end = window_end or end
    result = _result(engine, before, setting, batch, sum(map(len, outputs)), counted, end - start,
                     window_end - (window_start or window_end), None if baseline is None else outputs == baseline,
                     verifying, plain, replays_before)
    return result, outputs


def profile_decode(llm, prompts: list[list[int]], max_tokens: int, steps: int) -> str:
    """torch.profiler's tables of the operations' device time and host time
    over `steps` decode steps of these prompts, largest first. Its own host
    overhead slows the steps (CUDA graph launches most: 0.35 ms against
    5 us without it, H100), so this runs after the timed run, not during it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tandem.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    started: set[str] = set()
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished() and len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    _sync(engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    done = 0
    with profile(activities=activities) as prof:
        while engine.has_unfinished() and done < steps:
            engine.step()
            done += 1
        _sync(engine)
    engine.abort(ids)
    while engine.has_unfinished():
        engine.step()
    header = f"torch.profiler over {done} decode steps (times are totals; divide by {done} for a step)"
    table = prof.key_averages()
    host = "the host's own time (self CPU), largest first\n" + table.table(sort_by="self_cpu_time_total", row_limit=20)
    if not torch.cuda.is_available():
        return header + "\n" + host
    return (header + "\nthe device's time, largest first\n" + table.table(sort_by="self_cuda_time_total", row_limit=20)
            + "\n" + host)


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    from tandem.engine import LLM, SamplingParams

    if args.rounds < 1:
        print("--rounds must be at least 1", file=sys.stderr)
        return 2
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    specs = args.speculative_config or DEFAULT_SPECS
    # Short labels for the table (the JSON settings share their first 58 characters); a legend names them.
    settings: list[tuple[str, Optional[str]]] = [("none", None)] + [(f"S{i}", s) for i, s in enumerate(specs, 1)]
    for label, spec in settings[1:]:
        print(f"{label}: {spec}")
    results: list[SpecResult] = []
    baselines: dict[int, list[list[int]]] = {}

    def engine(index: int, spec: Optional[str]):
        overrides: dict = {"speculative_config": spec, "max_num_seqs": max(batch_sizes)}
        if args.rounds > 1 and args.gpu_memory_utilization == EngineArgs.gpu_memory_utilization:
            # All settings' engines live in this process at once, and an engine's
            # share counts what the process holds already: the i-th of n takes
            # (i + 1) / n of the default, so each gets about 1 / n of it.
            overrides["gpu_memory_utilization"] = args.gpu_memory_utilization * (index + 1) / len(settings)
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, **overrides))
        llm.generate([llm.encode("Warm up: repeat this, repeat this.")],
                     SamplingParams(temperature=0, max_tokens=8))  # one-time costs out of the timing
        return llm

    # One round: each setting's engine is built, run and dropped. Several: every
    # engine is built first and kept, so the rounds alternate between settings
    # without paying for a start each time.
    kept = [engine(i, spec) for i, (_, spec) in enumerate(settings)] if args.rounds > 1 else None
    for round_ in range(args.rounds):
        order = list(enumerate(settings))
        if round_ % 2:
            order.reverse()
        for index, (name, spec) in order:
            llm = kept[index] if kept is not None else engine(index, spec)
            for batch in batch_sizes:
                # Every run of every round against the first run without speculation.
                if args.steady:
                    prompts = _prompts(llm, STEADY_WAVES * batch, not args.no_chat_template, args.workload)
                    result, outputs = measure_steady(llm, prompts, batch, args.max_tokens, name,
                                                     baselines.get(batch))
                else:
                    prompts = _prompts(llm, batch, not args.no_chat_template, args.workload)
                    result, outputs = measure(llm, prompts, args.max_tokens, name, baselines.get(batch))
                result.round = round_
                if spec is None and batch not in baselines:
                    baselines[batch] = outputs
                results.append(result)
                share = result.speculating_share
                governed = "" if share is None else (f", governor: {share:.0%} of decode steps speculating, "
                                                     f"choices at the end {result.governor_leaders}, "
                                                     f"bursts skipped so far {result.governor_skipped_bursts} "
                                                     f"(shadow lookups {result.governor_shadow_lookups})")
                print(f"round {round_} {name} batch {batch}: {result.decode_tokens_per_s:.1f} decode tok/s, "
                      f"acceptance {result.acceptance_rate:.2f}, {result.tokens_per_step:.2f} tokens/step"
                      f"{governed}", file=sys.stderr)
                print(f"  verifying steps: {result.verifying_steps.line()}; {result.verify_graph_replays} "
                      f"replayed a CUDA graph\n  plain steps: {result.plain_steps.line()}", file=sys.stderr)
                for line in result.governor_report:
                    print(f"  governor {line}", file=sys.stderr)
            if args.profile_steps > 0 and round_ == 0:
                prompts = _prompts(llm, max(batch_sizes), not args.no_chat_template, args.workload)
                print(f"{name} batch {max(batch_sizes)}:\n"
                      f"{profile_decode(llm, prompts, args.max_tokens, args.profile_steps)}", file=sys.stderr)
            if kept is None:
                del llm
                gc.collect()
    print(format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "handler"},
                       "results": [asdict(r) | {"decode_tokens_per_s": r.decode_tokens_per_s,
                                                "acceptance_rate": r.acceptance_rate,
                                                "tokens_per_step": r.tokens_per_step,
                                                "speculating_share": r.speculating_share} for r in results]},
                      f, indent=2, default=str)
    return 0


def speedup(r: SpecResult, results: list[SpecResult]) -> Optional[float]:
    """r's decode tok/s over its round's run without speculation at its batch; None without one."""
    for base in results:
        if base.setting == "none" and (base.round, base.batch_size) == (r.round, r.batch_size):
            return r.decode_tokens_per_s / base.decode_tokens_per_s if base.decode_tokens_per_s else None
    return None


def speedups(results: list[SpecResult]) -> dict[tuple[str, int], list[float]]:
    """Per (setting, batch): each round's speedup(), in the rounds' order."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in results:
        up = speedup(r, results)
        if up is not None:
            out.setdefault((r.setting, r.batch_size), []).append(up)
    return out


def format_table(results: list[SpecResult]) -> str:
    """Each run, then (with several rounds) each setting's median and range of speed-ups."""
    lines = [f"{'setting':<10}{'round':>6}{'batch':>6}{'decode tok/s':>14}{'speedup':>9}{'accept':>8}"
             f"{'tok/step':>9}{'spec':>6}{'same':>6}"]
    for r in results:
        up = speedup(r, results) or 0.0
        same = "-" if r.same_as_baseline is None else ("yes" if r.same_as_baseline else "NO")
        share = "-" if r.speculating_share is None else f"{r.speculating_share:.0%}"
        lines.append(f"{r.setting[:8]:<10}{r.round:>6}{r.batch_size:>6}{r.decode_tokens_per_s:>14.1f}{up:>8.2f}x"
                     f"{r.acceptance_rate:>8.2f}{r.tokens_per_step:>9.2f}{share:>6}{same:>6}")
    rounds = {r.round for r in results}
    if len(rounds) > 1:
        lines.append("")
        lines.append(f"{'setting':<10}{'batch':>6}{'median speedup':>16}{'min':>8}{'max':>8}  over {len(rounds)} rounds")
        for (setting, batch), values in speedups(results).items():
            if setting == "none":
                continue
            lines.append(f"{setting[:8]:<10}{batch:>6}{statistics.median(values):>15.2f}x{min(values):>7.2f}x"
                         f"{max(values):>7.2f}x")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.spec_decode",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
