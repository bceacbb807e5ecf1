"""The processes of `tandem up`: starting one (again), waiting for its
listening line, reading its log, stopping them all."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

from tandem.services.common.parent_death import die_with_parent

LISTENING = re.compile(r"^(\w+) listening on (\S+):(\d+)\s*$")


@dataclass
class Child:
    """One process of the stack. `argv` restarts it exactly (tests do that)."""

    name: str  # e.g. prefill-0
    role: str
    argv: list[str]
    log_path: str
    metrics_port: Optional[int] = None
    address: Optional[str] = None  # host:port: planned (engines, store), or read from the listening line
    pid: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    # Variables of the launcher's environment the child does not inherit (the
    # engine settings' env twins: the launcher passes those as flags).
    env_unset: frozenset[str] = frozenset()
    process: Optional[subprocess.Popen] = field(default=None, repr=False)
    restarts: int = 0  # starts by the supervisor after the first
    listening: bool = False  # the current run has printed its listening line
    log_offset: int = 0  # where the current run's output begins in log_path

    def describe(self) -> dict:
        return {name: getattr(self, name) for name in
                ("name", "role", "argv", "env", "log_path", "metrics_port", "address", "pid",
                 "restarts")}


def start_child(child: Child) -> None:
    """Start `child`, or start it again: a first start empties its log (a
    reused --log-dir must not show stale listening lines), a restart appends
    to it after a marker, so the crash that caused it stays readable."""
    if child.restarts == 0:
        log = open(child.log_path, "wb")
    else:
        log = open(child.log_path, "ab")
        log.write(f"\n--- tandem up: restart {child.restarts} ---\n".encode())
        log.flush()
    child.log_offset = log.tell()
    child.listening = False
    env = {k: v for k, v in os.environ.items() if k not in child.env_unset}
    env.update(PYTHONUNBUFFERED="1", **child.env)
    child.process = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
    child.pid = child.process.pid
    log.close()


def check_listening(child: Child) -> bool:
    """Whether the current run of `child` has printed its listening line
    (then its address is set)."""
    if not child.listening:
        with open(child.log_path, "rb") as f:
            f.seek(child.log_offset)
            for line in f:
                m = LISTENING.match(line.decode(errors="replace").strip())
                if m and m.group(1) == child.role:
                    child.address = f"{m.group(2)}:{m.group(3)}"
                    child.listening = True
                    break
    return child.listening


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


def log_tail(child: Child, lines: int = 30) -> str:
    try:
        with open(child.log_path, "r", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_listening(children: list[Child], timeout_s: float, progress=None) -> None:
    """Block until every child printed its listening line; raise if one exits or
    the deadline passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            if check_listening(child):
                pending.remove(child)
                if progress:
                    progress(f"{child.name} listening on {child.address}")
            elif child.process.poll() is not None:
                raise RuntimeError(f"{child.name} {exit_text(child.process.returncode)} while "
                                   f"starting; last lines of {child.log_path}:\n{log_tail(child)}")
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise RuntimeError(f"{names} did not start within {timeout_s:.0f}s; see their logs in "
                               f"{os.path.dirname(pending[0].log_path)}")
        time.sleep(0.1)


def stop_children(children: list[Child], grace_s: float = 10.0) -> None:
    """Terminate in reverse start order (router first, store last), then kill
    what is still running after grace_s."""
    for child in reversed(children):
        if child.process and child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + grace_s
    for child in reversed(children):
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


