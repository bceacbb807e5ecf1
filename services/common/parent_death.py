"""Tie a child process's life to its parent's."""
from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Have this process get SIGTERM when its parent dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG; as a Popen preexec_fn, or first thing in a
    pool worker). Elsewhere it does nothing: the parent's own cleanup still
    stops its children when it can. The parent is the thread that started
    this process: start it from a thread that lives as long as it should."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
