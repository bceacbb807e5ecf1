"""The decode kernel's switches for a bench's engine (`--decode-kernel`).

DecodeConfig's grid_heads_first and values_after_scores
(kernels/attention_triton.py) are off by default until a GPU measures them.
`tandem bench kernels --decode-variants` times them on the kernel alone; this
puts them under a whole engine (its CUDA graphs, its warm-up, the offline
workload), so the two settings can be compared in one lease, one process each,
without editing the defaults.

The engine reads attention_triton.DEFAULT_CONFIG at each call (no config is
passed down from the engine), so replacing it before the engine starts is
what a changed default would do. A tensor-parallel engine's other ranks run
in processes of their own that never see the replacement: refused there.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

# flag value -> DecodeConfig field
DECODE_SWITCHES = {"heads-first": "grid_heads_first", "values-after-scores": "values_after_scores"}


def add_decode_switch_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--decode-kernel", action="append", default=[], choices=sorted(DECODE_SWITCHES), metavar="SWITCH",
        help="turn on a switch of the decode attention kernel for this run (repeat for both): "
             "heads-first (the grid's KV heads before its sequences, so one sequence's heads read "
             "its blocks together) or values-after-scores (a tile's values loaded after its scores); "
             "both off by default (docs/kernels.md). One-GPU engines only")


def apply_decode_switches(switches: list[str], tensor_parallel_size: int = 1) -> dict[str, bool]:
    """Set the named switches on attention_triton.DEFAULT_CONFIG (the others as
    they are) and return every switch's state, for the run's JSON."""
    from tandem.kernels import attention_triton

    unknown = [s for s in switches if s not in DECODE_SWITCHES]
    if unknown:
        raise ValueError(f"--decode-kernel: unknown switch {unknown[0]!r}; one of {sorted(DECODE_SWITCHES)}")
    if switches and tensor_parallel_size > 1:
        raise ValueError("--decode-kernel applies to one-GPU engines: the other ranks of "
                         f"--tensor-parallel-size {tensor_parallel_size} run in processes that keep the defaults")
    decode = attention_triton.DEFAULT_CONFIG.decode
    if switches:
        decode = dataclasses.replace(decode, **{DECODE_SWITCHES[s]: True for s in switches})
        attention_triton.DEFAULT_CONFIG = dataclasses.replace(attention_triton.DEFAULT_CONFIG, decode=decode)
        print(f"decode kernel switches on: {', '.join(switches)}", file=sys.stderr)
    return {flag: getattr(decode, field) for flag, field in DECODE_SWITCHES.items()}


# The offline workload's decode steps run 256-800 sequences of about 704
# tokens (docs/benchmarks.md): the shapes a switch must win at to be tried
# under the engine.
PICK_MIN_BATCH = 256


def pick_switches(report: dict, min_batch: int = PICK_MIN_BATCH) -> tuple[list[str], str]:
    """From `tandem bench kernels --decode-variants`' JSON: the switches of the
    engine-layout variant (tokens-outer) that took the least time summed over
    the shapes of at least min_batch sequences, and a line saying why. No
    switches where the defaults themselves were the fastest."""
    rows = [r for r in report.get("decode_variants", []) if r["layout"] == "tokens-outer"]
    if not rows:
        raise ValueError("no tokens-outer rows under decode_variants: not a --decode-variants report")
    keep = [i for i, (batch, _) in enumerate(rows[0]["shapes"]) if batch >= min_batch]
    if not keep:
        raise ValueError(f"no shape of at least {min_batch} sequences in {rows[0]['shapes']}")

    def total_us(row: dict) -> float:
        return sum(row["us"][i] for i in keep)

    best = min(rows, key=total_us)
    default = next(r for r in rows if not r["grid_heads_first"] and not r["values_after_scores"])
    switches = [flag for flag, field in DECODE_SWITCHES.items() if best[field]]
    why = (f"over {len(keep)} shapes of >= {min_batch} sequences: {total_us(best):.0f} us "
           f"({', '.join(switches) or 'the defaults'}) against the defaults' {total_us(default):.0f} us")
    return switches, why


def main(argv: list[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(
        prog="python -m tandem.bench.decode_switches",
        description="Print the --decode-kernel flags of the fastest engine-layout variant in a "
                    "`tandem bench kernels --decode-variants` JSON (nothing where the defaults won), "
                    "so a script can run the engine with them; why, on standard error.")
    parser.add_argument("report", help="the --json file of `tandem bench kernels --decode-variants`")
    parser.add_argument("--min-batch", type=int, default=PICK_MIN_BATCH,
                        help=f"count only shapes of at least this many sequences (default {PICK_MIN_BATCH})")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        switches, why = pick_switches(json.load(f), args.min_batch)
    print(why, file=sys.stderr)
    print(" ".join(f"--decode-kernel {s}" for s in switches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
