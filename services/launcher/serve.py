"""`tandem serve ROLE`: one role in the foreground, what a container runs."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from tandem.services.common.grpc_server import exit_after_shutdown

ROLES = ("router", "prefill", "decode", "kvstore")


def _role_module(role: str):
    return importlib.import_module(f"tandem.services.{role}.server")


def _serve_role(args: argparse.Namespace) -> NoReturn:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = int(_role_module(args.role).serve(args) or 0)
    # The role has shut down gracefully; a container's process must now end.
    exit_after_shutdown(code)


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="run one role in the foreground",
        description="Run one role (what a container runs). Every flag has a TANDEM_ env twin.")
    roles = serve.add_subparsers(dest="role", metavar="ROLE", required=True)
    for role in ROLES:
        try:
            module = _role_module(role)
        except ImportError as exc:  # a role whose module is missing must not break the CLI
            p = roles.add_parser(role, help=f"(unavailable: {exc})")
            p.set_defaults(handler=lambda args, e=exc: sys.exit(f"error: role unavailable: {e}"))
            continue
        p = roles.add_parser(role, help=(module.__doc__ or "").strip().splitlines()[0],
                             description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(handler=_serve_role)
