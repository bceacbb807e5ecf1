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

`python -m tandem.bench.decode_switches REPORT --layout L` reads a
`--decode-variants` report and prints the engine flags of the fastest
variant of block layout L (with `--kv-cache-layout HND` for heads-outer),
or nothing where it is not clearly faster than the defaults:
`bash bench/gpu_figures.sh decode-ab` runs the engine with what it prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

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


# `tandem bench kernels --decode-variants`' layout names -> the engine's --kv-cache-layout
ENGINE_LAYOUTS = {"tokens-outer": "NHD", "heads-outer": "HND"}


# A pick must take this much less time than the defaults to be worth an
# engine run: the same kernel's rate differed by up to 1.5% between two
# calls on two leases (prefill, 520 against 528 TFLOP/s; docs/benchmarks.md,
# the thirty-fourth session).
PICK_MARGIN = 0.02


def pick_switches(report: dict, layout: str = "tokens-outer", min_batch: int = PICK_MIN_BATCH,
                  margin: float = PICK_MARGIN) -> tuple[Optional[list[str]], str]:
    """From `tandem bench kernels --decode-variants`' JSON: the switches of the
    variant of this block layout that took the least time summed over the
    shapes of at least min_batch sequences, and a line saying why, against
    the engine's defaults (tokens-outer blocks, no switch). None where that
    variant is not at least `margin` faster than the defaults."""
    if layout not in ENGINE_LAYOUTS:
        raise ValueError(f"layout: one of {sorted(ENGINE_LAYOUTS)}, got {layout!r}")
    variants = report.get("decode_variants", [])
    default = next((r for r in variants if r["layout"] == "tokens-outer"
                    and not r["grid_heads_first"] and not r["values_after_scores"]), None)
    rows = [r for r in variants if r["layout"] == layout]
    if default is None or not rows:
        raise ValueError(f"no default or {layout} rows under decode_variants: not a --decode-variants report")
    keep = [i for i, (batch, _) in enumerate(default["shapes"]) if batch >= min_batch]
    if not keep:
        raise ValueError(f"no shape of at least {min_batch} sequences in {default['shapes']}")

    def total_us(row: dict) -> float:
        return sum(row["us"][i] for i in keep)

    best = min(rows, key=total_us)
    switches = [flag for flag, field in DECODE_SWITCHES.items() if best[field]]
    faster = total_us(best) < (1.0 - margin) * total_us(default)
    why = (f"{layout} over {len(keep)} shapes of >= {min_batch} sequences: {total_us(best):.0f} us "
           f"({', '.join(switches) or 'no switch'}) against the defaults' {total_us(default):.0f} us: "
           + ("worth an engine run" if faster else f"not {margin:.0%} faster, no engine run"))
    return (switches if faster else None), why


def engine_flags(switches: list[str], layout: str) -> str:
    """The engine bench's flags for this layout and these switches ("": the defaults)."""
    flags = [] if layout == "tokens-outer" else [f"--kv-cache-layout {ENGINE_LAYOUTS[layout]}"]
    return " ".join(flags + [f"--decode-kernel {s}" for s in switches])


def main(argv: list[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(
        prog="python -m tandem.bench.decode_switches",
        description="Print the engine bench flags (--kv-cache-layout, --decode-kernel) of the fastest "
                    "variant of one block layout in a `tandem bench kernels --decode-variants` JSON, "
                    "so a script can run the engine with them; nothing where that variant is not "
                    "--margin faster than the defaults; why, on standard error.")
    parser.add_argument("report", help="the --json file of `tandem bench kernels --decode-variants`")
    parser.add_argument("--layout", choices=sorted(ENGINE_LAYOUTS), default="tokens-outer",
                        help="the block layout whose variants compete (default tokens-outer, the "
                             "engine's NHD; heads-outer is --kv-cache-layout HND)")
    parser.add_argument("--min-batch", type=int, default=PICK_MIN_BATCH,
                        help=f"count only shapes of at least this many sequences (default {PICK_MIN_BATCH})")
    parser.add_argument("--margin", type=float, default=PICK_MARGIN,
                        help=f"how much less time than the defaults a pick must take (default {PICK_MARGIN})")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        switches, why = pick_switches(json.load(f), args.layout, args.min_batch, args.margin)
    print(why, file=sys.stderr)
    print("" if switches is None else engine_flags(switches, args.layout))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
