"""`tandem up` (the whole stack on one machine: up.py; its plan: plan.py; its
processes: children.py; restarting them: supervisor.py) and `tandem serve
ROLE` (one role in the foreground, what a container runs: serve.py)."""
from __future__ import annotations

import argparse
from typing import Optional


def register(subparsers) -> None:
    from tandem.services.launcher import serve, up

    parser = subparsers.add_parser(
        "up", help="run the whole stack on this machine",
        description="Start kvstore, prefill, decode and the router on loopback and print where to "
                    "point a client. A process that exits is restarted on its own port after a "
                    "back-off (--no-restart: the stack stops instead). Ctrl+C (or SIGTERM) stops "
                    "everything. The engine flags (model, KV cache, scheduler, runtime) go to every "
                    "prefill and decode engine as given; --model, --tokenizer, --revision and "
                    "--download-dir to the router too.")
    up.add_up_arguments(parser)
    parser.set_defaults(handler=up.cmd_up)
    serve.register(subparsers)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m tandem.services.launcher up|serve ...`: the same commands as
    `tandem up|serve`, without loading the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
