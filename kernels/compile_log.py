"""Counts the Triton kernels this process compiles, and names the last ones.

A kernel variant Triton meets for the first time compiles on the thread that
launches it: a serving engine's step waits for it, up to a second. The engine
compiles the variants it can meet before it serves (engine/kernel_warmup.py);
this count shows whether that worked (the warm-up's report, the slow-step log,
tests/gpu/test_kernel_warmup_gpu.py).
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Optional

_lock = threading.Lock()
_count = 0
_recent: collections.deque[str] = collections.deque(maxlen=8)
_installed: Optional[bool] = None  # None: not tried yet; False: this Triton has no hook


def _hook_slot() -> Any:
    """Triton's runtime knobs, where this Triton has a post-compile hook (3.4 and later)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


def install() -> bool:
    """Start counting (once per process; any hook already there still runs).
    False where this Triton offers no hook to count with."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        slot = _hook_slot()
        if slot is None:
            _installed = False
            return False
        previous = slot.jit_post_compile_hook

        def on_compile(*args: Any, **kwargs: Any) -> Any:
            global _count
            fn = kwargs.get("fn")
            with _lock:
                _count += 1
                _recent.append(getattr(fn, "name", None) or "?")
            return previous(*args, **kwargs) if previous is not None else None

        slot.jit_post_compile_hook = on_compile
        _installed = True
        return True


def compiles() -> int:
    """Kernels compiled since install() (0 without a hook)."""
    return _count


def recent(since: int) -> list[str]:
    """The names of the kernels compiled after compiles() read `since` (the last 8 at most)."""
    with _lock:
        n = min(_count - since, len(_recent))
        return list(_recent)[len(_recent) - n:] if n > 0 else []
