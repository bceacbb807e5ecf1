"""Command-line flags with environment-variable twins, and settings
dataclasses whose fields declare their own flags.

Every flag `--foo-bar` may also be set as TANDEM_FOO_BAR (the same name for
every role, so one env block in a container spec configures it).
Precedence: command line, then environment, then the default. A switch's twin
takes 1/0, true/false, yes/no, on/off; a bad value in a twin stops the start
with an error naming the variable.

A settings dataclass (EngineArgs) declares each flag once, on its field
(`flag_field`): the flag's name, help and choices come from there, its type
and choices from the annotation (a Literal lists the choices), so the parser,
the env twins, `--help`, the launcher's command lines and the Helm chart's
schema cannot drift apart. This module needs nothing beyond the standard
library: the router imports it, and must not load torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Callable, NoReturn, Optional

ENV_PREFIX = "TANDEM_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def config_error(message: str) -> NoReturn:
    """Stop at start over a bad setting: `error: MESSAGE` on stderr and exit
    status 2, as argparse does for bad usage; no traceback. The message names
    the flag and says what to do."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}; use 1/0, true/false, yes/no or on/off")


def _from_env(flag: str, type: Optional[Callable[[str], Any]], choices: Any, nargs: Any) -> tuple[bool, Any]:
    """(whether the twin is set, its value parsed as the flag would parse it)."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is None:
        return False, None
    try:
        if type is bool:
            return True, parse_bool(raw)
        convert = type or str
        # A flag that takes several values takes them comma-separated in its env twin.
        value = [convert(v) for v in raw.split(",")] if nargs else convert(raw)
    except ValueError as exc:
        config_error(f"{env}={raw!r} is not valid for {flag}: {exc}")
    # argparse checks choices on the command line only, not on defaults: check the twin here.
    if choices is not None and any(v not in choices for v in (value if nargs else [value])):
        config_error(f"{env}={raw!r} is not valid for {flag}: choose from "
                     + ", ".join(str(c) for c in choices))
    return True, value


def add_flag(parser: Any, flag: str, *, default: Any = None,
             type: Optional[Callable[[str], Any]] = str, help: str = "", **kwargs: Any) -> None:
    """Add `flag` whose default comes from its TANDEM_ env twin when set.

    type=bool makes a switch (`--flag` sets it; the twin accepts 1/0, true/false, ...).
    `parser` may be an argument group.
    """
    env = env_name(flag)
    is_set, value = _from_env(flag, type, kwargs.get("choices"), kwargs.get("nargs"))
    if type is bool:
        parser.add_argument(flag, action="store_true", default=value if is_set else bool(default),
                            help=f"{help} [env {env}]", **kwargs)
        return
    if is_set:
        default = value
    shown = "" if default is None else f" (default: {default})"
    parser.add_argument(flag, default=default, type=type, help=f"{help}{shown} [env {env}]", **kwargs)


# --- settings dataclasses --------------------------------------------------------

def flag_field(default: Any, help: str, *, flag: Optional[str] = None, negated: bool = False,
               group: str = "", metavar: Optional[str] = None) -> Any:
    """A dataclass field that is a command-line flag.

    flag: the flag's name when it is not `--field-name` (kept for compatibility);
    negated: a switch that sets the field False (`--no-prefix-caching` for
    enable_prefix_caching=True); group: the section of `--help` it is listed in.
    """
    return dataclasses.field(default=default, metadata={
        "cli": True, "help": help, "flag": flag, "negated": negated, "group": group,
        "metavar": metavar})


def internal_field(default: Any = None, *, why: str) -> Any:
    """A field that is no flag: set by code (an object, or what a role decides). `why` documents it."""
    return dataclasses.field(default=default, metadata={"cli": False, "why": why})


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """What a field's flag is, derived once from the field and its annotation."""

    name: str  # the field's name (the argparse dest, the Helm key, the LLM keyword)
    flag: str
    type: type  # bool, int, float or str
    optional: bool  # None is a value (unset)
    choices: Optional[tuple]
    default: Any
    help: str
    negated: bool
    group: str
    metavar: Optional[str]

    @property
    def env(self) -> str:
        return env_name(self.flag)


def _unwrap(hint: Any) -> tuple[Any, bool, Optional[tuple]]:
    """(base type, whether Optional, Literal choices) of an annotation."""
    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        (hint,) = args
    if typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), optional, choices
    return hint, optional, None


def flag_specs(cls: type) -> list[FlagSpec]:
    """The flags of a settings dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli"):
            continue
        base, optional, choices = _unwrap(hints[f.name])
        if base not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a flag must be bool, int, float or str, not {base}")
        m = f.metadata
        specs.append(FlagSpec(name=f.name, flag=m["flag"] or "--" + f.name.replace("_", "-"), type=base,
                              optional=optional, choices=choices, default=f.default, help=m["help"],
                              negated=m["negated"], group=m["group"], metavar=m["metavar"]))
    return specs


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                        defaults: Optional[dict[str, Any]] = None) -> None:
    """Add a flag (with its env twin) for every flag field of `cls` but those in
    `skip`, listed by group in `--help`. defaults: a command's own defaults
    for some fields (a benchmark that runs on the CPU unless told otherwise)."""
    defaults = defaults or {}
    groups: dict[str, Any] = {}
    for spec in flag_specs(cls):
        if spec.name in skip:
            continue
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group) if spec.group else parser
        target = groups[spec.group]
        default = defaults.get(spec.name, spec.default)
        if spec.type is bool and spec.negated:
            is_set, value = _from_env(spec.flag, bool, None, None)
            target.add_argument(spec.flag, dest=spec.name, action="store_false",
                                default=(not value) if is_set else default,
                                help=f"{spec.help} [env {spec.env}]")
            continue
        kwargs: dict[str, Any] = {"dest": spec.name}
        if spec.choices is not None:
            kwargs["choices"] = spec.choices
        if spec.metavar and spec.type is not bool:
            kwargs["metavar"] = spec.metavar
        add_flag(target, spec.flag, default=default, type=spec.type, help=spec.help, **kwargs)


def from_namespace(cls: type, namespace: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `cls` from parsed flags (fields a parser skipped keep their defaults)."""
    values = {s.name: getattr(namespace, s.name) for s in flag_specs(cls) if hasattr(namespace, s.name)}
    return cls(**{**values, **overrides})


def to_cli_args(obj: Any) -> list[str]:
    """The flags that reproduce `obj`'s values that differ from the defaults
    (for a child process parsing the same flags)."""
    argv: list[str] = []
    for spec in flag_specs(type(obj)):
        value = getattr(obj, spec.name)
        if value == spec.default or value is None:
            continue
        if spec.type is bool:
            if bool(value) != spec.negated:  # a switch can only say what differs from its default
                argv.append(spec.flag)
            continue
        argv += [spec.flag, str(value)]
    return argv
