"""`tandem bench throughput`: offline tokens/s of the engine against HF
transformers `generate` on the same prompts and the same output lengths, and
the engine's fraction of the compute roofline (bench/roofline.py: the
workload's arithmetic at this device's matmul peak, measured in the same run,
against the time it took)."""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

from tandem.bench.decode_switches import add_decode_switch_flag, apply_decode_switches
from tandem.bench.gpu_clocks import ClockSampler
from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs

if TYPE_CHECKING:
    from tandem.bench.step_breakdown import StepRecorder


@dataclass
class ThroughputResult:
    system: str
    num_prompts: int
    input_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "throughput", help="offline throughput: engine vs HF transformers generate",
        description="Generates the same seeded prompts with the tandem engine and with HF "
                    "transformers `generate` (greedy, fixed output length, EOS ignored) and prints "
                    "output tokens/s of each and their ratio, and the engine's fraction of the compute "
                    "roofline: 2 x parameters x (prompt + output tokens) FLOPs at this device's matmul "
                    "peak in the engine's precision (bf16, or FP8 with --quantization fp8), measured in "
                    "the same run, against the time the engine took.")
    p.add_argument("--preset", default=None,
                   help="dummy weights of this architecture instead of --model: llama-3-8b, qwen3-0.6b")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--dataset", choices=["uniform", "sharegpt"], default="uniform",
                   help="uniform: --input-len range and --output-len for all; sharegpt: ShareGPT-like "
                        "log-normal input and output lengths (bench/datasets.py), seeded")
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   help="prompt lengths drawn uniformly in [MIN, MAX] (default 32 256)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF generate batch size (left padding)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and their lengths")
    p.add_argument("--output-json", default=None, help="write results here")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (default 0: greedy; the OpenAI API's "
                        "default is 1); the HF baseline stays greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default 1: off)")
    p.add_argument("--structured", choices=["none", "json", "both"], default="none",
                   help="json: every request's output follows a JSON schema (an array of at least "
                        "10,000 integers, so no answer can finish before --output-len and every token "
                        "goes through the grammar's mask); both: after an untimed warm-up pass, the "
                        "engine runs the prompts without and then with the schema and prints the "
                        "slowdown (default none)")
    p.add_argument("--step-breakdown", action="store_true",
                   help="after the run, the first pass's time by the path its engine steps took (decode "
                        "graphs, verifying graphs, piecewise graphs, eager), each beside the compute "
                        "roofline of its tokens (bench/step_breakdown.py)")
    add_decode_switch_flag(p)
    EngineArgs.add_cli_args(p, skip=KV_TRANSFER_FIELDS)
    p.set_defaults(handler=run)


def make_workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and the number of tokens to generate for each."""
    rng = random.Random(args.seed)
    if args.dataset == "sharegpt":
        from tandem.bench.datasets import ShareGPTLike

        shape = ShareGPTLike(max_input_len=1024, max_output_len=512)
        lengths = [shape.draw(rng) for _ in range(args.num_prompts)]
    else:
        lengths = [(rng.randint(*args.input_len), args.output_len) for _ in range(args.num_prompts)]
    # token ids from the middle of the vocabulary: ordinary tokens, no specials
    prompts = [[rng.randrange(1000, min(vocab, 30000)) for _ in range(n_in)] for n_in, _ in lengths]
    return prompts, [n_out for _, n_out in lengths]


# An answer that cannot finish within any --output-len: every token is masked.
LONG_JSON_SCHEMA = {"type": "object", "properties": {"values": {
    "type": "array", "items": {"type": "integer"}, "minItems": 10_000}}, "required": ["values"]}


def run_engine(args, prompts, output_lens, llm=None, structured: bool = False,
               record_steps: bool = False) -> tuple[ThroughputResult, object, Optional[StepRecorder]]:
    """(the pass's result, the LLM, with record_steps the timed pass's StepRecorder)."""
    from tandem.bench.step_breakdown import StepRecorder
    from tandem.engine import LLM, SamplingParams, StructuredOutputs

    from tandem.bench.presets import with_preset

    if llm is None:
        llm = LLM.from_engine_args(with_preset(EngineArgs.from_cli_args(args), args.preset))
    if structured:
        # A finished grammar would stop the answer early; this one cannot
        # finish, so ignore_eos is not needed (nor allowed with a grammar).
        so = StructuredOutputs(json=LONG_JSON_SCHEMA)
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n,
                                 structured_outputs=so) for n in output_lens]
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, structured_outputs=so))  # warm-up, compile
    else:
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n, ignore_eos=True)
                  for n in output_lens]
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    _sync(llm.engine.runner.device)
    recorder = StepRecorder(llm.engine) if record_steps else None
    start = time.perf_counter()
    with recorder or contextlib.nullcontext():
        outs = llm.generate(prompts, params)
    _sync(llm.engine.runner.device)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    name = "tandem+json-schema" if structured else "tandem"
    return ThroughputResult(name, len(prompts), sum(map(len, prompts)), produced, seconds), llm, recorder


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run_hf(args, prompts, output_lens, llm) -> ThroughputResult:
    """HF transformers generate on the same weights (copied from the engine's model).

    Requests are sorted by length and batched (left padding); a batch runs
    until its longest output. Only the requested tokens count as output.
    """
    import torch
    from transformers import AutoModelForCausalLM

    runner = llm.engine.runner
    config = llm.engine.info.hf_config
    # Give the engine's KV cache back first: HF needs the memory for its own.
    runner.kv_caches.clear()
    runner.kv_cache = None  # the layers' caches were views of it
    runner.graphs = None
    import gc

    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    with torch.device(runner.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=runner.dtype).eval()
    hf.load_state_dict(runner.model.state_dict(), strict=False)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), output_lens[i]))
    start = time.perf_counter()
    for i in range(0, len(order), args.hf_batch_size):
        chosen = order[i:i + args.hf_batch_size]
        batch = [prompts[j] for j in chosen]
        max_new = max(output_lens[j] for j in chosen)
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            out = hf.generate(ids.to(runner.device), attention_mask=mask.to(runner.device),
                              max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        assert out.shape[1] - width == max_new
    _sync(runner.device)
    seconds = time.perf_counter() - start
    return ThroughputResult("hf-transformers", len(prompts), sum(map(len, prompts)), sum(output_lens), seconds)


def run(args: argparse.Namespace) -> int:
    vocab = 49152
    if args.preset:
        from tandem.bench.presets import preset_config

        vocab = preset_config(args.preset).vocab_size
    prompts, output_lens = make_workload(args, vocab)
    apply_decode_switches(args.decode_kernel, args.tensor_parallel_size)  # args.decode_kernel goes into the JSON
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {sum(output_lens)} output "
          f"tokens ({args.dataset})", file=sys.stderr)
    results = []
    llm = None
    if args.structured == "both":
        # The first pass over the workload pays one-time costs (kernel
        # compilation for new shapes, allocator growth): untimed, so that
        # neither of the two compared passes carries them.
        _, llm, _ = run_engine(args, prompts, output_lens)
        print("warm-up pass done", file=sys.stderr)
    recorder, clock_readings = None, []
    for structured in {"none": [False], "json": [True], "both": [False, True]}[args.structured]:
        with ClockSampler(args.device) as clocks:
            ours, llm, recorded = run_engine(args, prompts, output_lens, llm, structured,
                                             record_steps=args.step_breakdown and not results)
        recorder = recorder or recorded
        print(f"{ours.system}: {ours.output_tokens_per_s:.1f} output tok/s in {ours.seconds:.2f} s",
              file=sys.stderr)
        if clocks.reading is not None:
            print(f"  during it: {clocks.reading.summary()}", file=sys.stderr)
        results.append(ours)
        clock_readings.append(asdict(clocks.reading) if clocks.reading else None)
    # Before the HF baseline, which takes the engine's memory: the engine's
    # first pass against this device's matmul peak, measured now.
    roofline = _roofline(llm, results[0])
    least = _least_time(llm, results[0], prompts, output_lens, roofline.sustained_flops)
    engine = _engine_report(llm)
    print(f"engine: max_num_seqs {engine['max_num_seqs']}, {engine['max_num_batched_tokens']} tokens a step, "
          f"{engine['kv_blocks']} KV blocks ({engine['kv_tokens']} tokens), {engine['preemptions']} preemptions, "
          f"admission {engine['admission']}"
          + (f", overcommit {engine['admission_overcommit']:g}" if engine["admission_overcommit"] else "")
          + f", tail {engine['admission_tail']:g} ({engine['admissions_deferred']} deferred, "
          f"{engine['admissions_tail']} admitted as a tail)", file=sys.stderr)
    if not args.no_hf:
        print("running the HF transformers baseline ...", file=sys.stderr)
        results.append(run_hf(args, prompts, output_lens, llm))
    print(f"{'system':<18}{'seconds':>10}{'output tok/s':>15}{'total tok/s':>14}")
    for r in results:
        print(f"{r.system:<18}{r.seconds:>10.2f}{r.output_tokens_per_s:>15.1f}{r.total_tokens_per_s:>14.1f}")
    print(f"compute roofline: {roofline.workload_flops / 1e12:.3g} TFLOP of arithmetic (2 x parameters x "
          f"tokens) at the {roofline.peak_flops / 1e12:.3g} TFLOP/s {roofline.precision} matmul peak measured "
          f"now = {roofline.workload_flops / roofline.peak_flops:.2f} s; took {roofline.seconds:.2f} s: "
          f"{roofline.fraction:.2f} of the roofline")
    if roofline.sustained_flops == roofline.sustained_flops:  # not NaN: a GPU
        print(f"  against the {roofline.sustained_flops / 1e12:.3g} TFLOP/s the same matmul sustains back to back "
              f"(the clock its power limit allows): {roofline.sustained_fraction:.2f}")
    if least is not None:
        print(f"the least this run could take here: {least.arithmetic_seconds:.2f} s of linear-layer arithmetic at "
              f"the sustained rate + {least.kv_read_seconds:.2f} s of decode KV reads ({least.kv_read_bytes / 1e12:.2f} "
              f"TB) at the {least.copy_bandwidth / 1e12:.2f} TB/s copy bandwidth = {least.seconds:.2f} s; took "
              f"{roofline.seconds:.2f} s: {least.seconds / roofline.seconds:.2f} of it. A run that took only that "
              f"would be at {roofline.workload_flops / roofline.peak_flops / least.seconds:.2f} of the roofline.")
    shares = None
    if recorder is not None:
        from tandem.bench.step_breakdown import print_shares

        # The first pass's steps; parameters per token as the roofline counted them.
        shares = recorder.shares(roofline.workload_flops / (results[0].input_tokens + results[0].output_tokens),
                                 roofline.peak_flops)
        print(f"the {results[0].system} pass by the path of its steps:")
        print_shares(shares)
    ratio: Optional[float] = None
    if results[-1].system == "hf-transformers":
        ratio = results[0].output_tokens_per_s / results[-1].output_tokens_per_s
        print(f"tandem / HF output throughput: {ratio:.2f}x")
    slowdown: Optional[float] = None
    if args.structured == "both":
        slowdown = 1 - results[1].output_tokens_per_s / results[0].output_tokens_per_s
        print(f"JSON schema on every request: {100 * slowdown:.1f}% slower than none")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args) | {"handler": None},
                       "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
                       "ratio": ratio, "structured_slowdown": slowdown, "engine": engine,
                       "roofline": asdict(roofline) | {"fraction": roofline.fraction,
                                                       "sustained_fraction": roofline.sustained_fraction},
                       "clocks": clock_readings,  # nvidia-smi's samples during each pass (None: no GPU)
                       "least_time": asdict(least) | {"seconds": least.seconds} if least else None,
                       "step_breakdown": [asdict(x) | {"of_roofline": x.of_roofline} for x in shares]
                       if shares is not None else None}, f, indent=2)
    return 0


def _engine_report(llm) -> dict:
    """The settings the engine ran with (defaults decided), its preemptions
    (a batch larger than the KV cache holds pays for them in recompute) and
    the steps its admission held a request back for KV headroom."""
    engine = llm.engine
    scheduler = engine.config.scheduler
    blocks = engine.kv.pool.num_usable_blocks
    stats = engine.stats()
    return {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "kv_blocks": blocks, "kv_tokens": blocks * engine.config.cache.block_size,
            "preemptions": stats.num_preemptions, "admission": scheduler.admission,
            "admission_overcommit": scheduler.admission_overcommit, "admission_tail": scheduler.admission_tail,
            "admissions_deferred": stats.num_admissions_deferred, "admissions_tail": stats.num_admissions_tail}


def _roofline(llm, result: ThroughputResult):
    from tandem.bench.roofline import measure

    runner = llm.engine.runner
    return measure(runner.model, runner.device, runner.dtype, runner.quantization == "fp8",
                   result.input_tokens + result.output_tokens, result.seconds)


def _least_time(llm, result: ThroughputResult, prompts: list[list[int]], output_lens: list[int],
                sustained_flops: float):
    """bench/roofline.py's LeastTime of the first pass (a GPU's: the
    sustained rate is one), or None."""
    import torch

    from tandem.bench.roofline import LeastTime, copy_bandwidth, decode_kv_tokens, gemm_flops

    runner = llm.engine.runner
    if runner.device.type != "cuda":
        return None
    kv_bytes_per_token = runner.layout.block_bytes // runner.block_size
    kv_tokens = decode_kv_tokens([len(p) for p in prompts], output_lens)
    try:
        bandwidth = copy_bandwidth(runner.device)  # 4 GiB of buffers beside the engine's cache
    except torch.OutOfMemoryError:
        print("no least time: the copy bandwidth's buffers do not fit beside the engine", file=sys.stderr)
        return None
    return LeastTime(gemm_flops(runner.model, result.input_tokens + result.output_tokens, result.output_tokens),
                     sustained_flops, float(kv_tokens * kv_bytes_per_token), bandwidth)


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.bench.throughput ...`: the same as `tandem bench throughput ...`."""
    parser = argparse.ArgumentParser(prog="tandem bench")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["throughput", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
