"""Python's garbage collector in a serving process: the objects made while
loading (the model's modules, the tokenizer, configs) are frozen out of every
later collection, and a collection that pauses the process long enough to
show in token latencies is logged.

Why: a full collection walks every tracked object, and an engine process
holds hundreds of thousands after loading a model; each such walk stops the
engine thread (and every request's next token) for its whole length. vLLM
freezes its startup objects for the same reason.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

# A collection at least this long is logged (a decode step is 5-20 ms).
SLOW_COLLECTION_S = 0.05


class _Timer:
    def __init__(self) -> None:
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        if took >= SLOW_COLLECTION_S:
            log.warning("garbage collection of generation %d paused this process for %.0f ms (%d objects "
                        "collected)", info.get("generation", -1), took * 1e3, info.get("collected", 0))


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now out of the collector's
    view (gc.freeze); returns how many were frozen. Call once, after loading."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def watch_pauses() -> None:
    """Log each collection that takes SLOW_COLLECTION_S or more (once per process)."""
    if not any(isinstance(cb, _Timer) for cb in gc.callbacks):
        gc.callbacks.append(_Timer())
