"""The `tandem` command. Each subcommand lives in its own module, which exposes
`register(subparsers)`; this file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds). Modules are imported only to build the parser; heavy
# imports (torch, transformers) happen inside each command's handler.
SUBCOMMANDS = [
    "tandem.engine.cli",  # generate
    "tandem.services.launcher",  # up, serve
    "tandem.bench.cli",  # bench
]


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, once installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="tandem: disaggregated prefill/decode LLM serving on a shared paged KV engine.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
