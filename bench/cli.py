"""`tandem bench ...`: adds the bench command and its subcommands to the tandem CLI.

Each subcommand module exposes `register(subparsers)` and sets its handler
with `parser.set_defaults(handler=fn)`, fn(args) -> exit code.
"""
from __future__ import annotations

from tandem.bench import admission_replay, kernels, kv, latency, mixed_steps, serve, spec_decode, sweep, throughput

SUBCOMMANDS = (serve, sweep, throughput, latency, mixed_steps, spec_decode, kernels, kv, admission_replay)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: serve, sweep, throughput, latency, mixed-steps, "
                                                "spec-decode, kernels, kv, admission-replay",
                                  description="Measure tandem (or any OpenAI-compatible server) and its parts.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.bench.cli serve ...`: the bench command without the rest of the tandem CLI."""
    import argparse

    parser = argparse.ArgumentParser(prog="tandem", description="tandem benchmarks")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    import sys

    sys.exit(main())
