"""CLI flags with environment-variable twins.

Every flag `--foo-bar` of role ROLE may also be set as TANDEM_FOO_BAR (the
role-independent form, so one env block in a container spec configures it).
Precedence: command line, then environment, then the default.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, NoReturn, Optional


def env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def config_error(message: str) -> NoReturn:
    """Stop at start over a bad setting: `error: MESSAGE` on stderr and exit
    status 2, as argparse does for bad usage; no traceback. The message names
    the flag and says what to do."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default: Any = None,
             type: Optional[Callable[[str], Any]] = str, help: str = "", **kwargs: Any) -> None:
    """Add `flag` whose default comes from its TANDEM_ env twin when set.

    type=bool makes a switch (`--flag` sets it; env accepts 1/0, true/false).
    """
    env = env_name(flag)
    raw = os.environ.get(env)
    if type is bool:
        value = _parse_bool(raw) if raw is not None else bool(default)
        parser.add_argument(flag, action="store_true", default=value,
                            help=f"{help} [env {env}]", **kwargs)
        return
    if raw is not None:
        try:
            # A flag that takes several values takes them comma-separated in its env twin.
            value = [type(v) for v in raw.split(",")] if kwargs.get("nargs") else type(raw)
        except ValueError as exc:
            raise SystemExit(f"error: {env}={raw!r} is not valid for {flag}: {exc}")
        default = value
    shown = "" if default is None else f" (default: {default})"
    parser.add_argument(flag, default=default, type=type, help=f"{help}{shown} [env {env}]", **kwargs)
