"""`tandem up`'s supervision of its children once the stack is up: a child
that exits is started again with its own command line, as Kubernetes'
restartPolicy Always does, after a back-off that doubles per restart in a
row. A child that exits before listening START_TRIES times in a row brings
the stack down with the tail of its log (with --no-restart: any child that
exits does, unless --keep-going)."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional

from tandem.services.launcher.children import Child, check_listening, exit_text, log_tail, start_child

# Restarts, shaped like Kubernetes' CrashLoopBackOff: the first waits
# --restart-backoff (default RESTART_BACKOFF_S), each next one in a row twice as long up to
# RESTART_BACKOFF_MAX_S; a child up RESTART_RESET_S starts over at the first.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_RESET_S = 60.0
# A child that exits this many times in a row before its listening line
# cannot start (bad flags, a taken port, a missing model): retrying forever
# would hide that, so the stack stops with its log.
START_TRIES = 5


@dataclass
class _Restarts:
    """The supervisor's view of one child's restarts."""

    backoff_s: float  # the wait before the next restart (--restart-backoff at first)
    restart_at: Optional[float] = None  # set while the child is down, waiting for its restart
    started_at: float = 0.0
    failed_starts: int = 0  # exits before the listening line, in a row
    abandoned: bool = False  # left dead: --no-restart or given up, with --keep-going


def supervise(children: list[Child], args: argparse.Namespace, stopping: dict, progress,
               save_state) -> int:
    """Watch the children until SIGINT/SIGTERM; returns `tandem up`'s exit status."""
    first_backoff_s = args.restart_backoff
    restarts = {c.name: _Restarts(backoff_s=first_backoff_s, started_at=time.monotonic()) for c in children}
    while stopping["signal"] is None:
        now = time.monotonic()
        for child in children:
            r = restarts[child.name]
            if r.abandoned:
                continue
            if r.restart_at is not None:
                if now >= r.restart_at:
                    r.restart_at, r.started_at = None, now
                    child.restarts += 1
                    start_child(child)
                    save_state()  # the new pid
                continue
            code = child.process.poll()
            if code is None:
                if not child.listening:
                    if check_listening(child):
                        progress(f"{child.name} listening on {child.address} again")
                elif now - r.started_at >= RESTART_RESET_S:
                    r.backoff_s = first_backoff_s
                continue
            exited = f"{child.name} (pid {child.pid}) {exit_text(code)}"
            r.failed_starts = 0 if child.listening else r.failed_starts + 1
            if args.no_restart or r.failed_starts >= START_TRIES:
                why = ("--no-restart" if args.no_restart else
                       f"it exited {r.failed_starts} times in a row before listening: given up")
                if not args.keep_going:
                    print(f"error: {exited} ({why}); last lines of {child.log_path}:\n"
                          f"{log_tail(child)}\nstopping the whole stack.", file=sys.stderr, flush=True)
                    return 1
                progress(f"warning: {exited} ({why}); --keep-going: the rest keeps serving")
                r.abandoned = True
                continue
            progress(f"{exited}; restarting in {r.backoff_s:g}s (restart {child.restarts + 1})")
            r.restart_at = now + r.backoff_s
            r.backoff_s = min(2 * r.backoff_s, RESTART_BACKOFF_MAX_S)
        time.sleep(0.2)
    progress(f"{stopping['signal']} received")
    return 0
