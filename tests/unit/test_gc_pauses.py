"""A serving process freezes what it made while loading out of garbage
collection, and logs a collection long enough to show in token latencies."""
from __future__ import annotations

import gc
import logging

from tandem.services.common import gc_pauses


def test_objects_alive_after_loading_are_frozen_and_slow_collections_are_logged(caplog, monkeypatch):
    loaded = [[i] for i in range(10_000)]  # what a model load leaves behind
    try:
        assert gc_pauses.freeze_startup_objects() >= len(loaded)
        monkeypatch.setattr(gc_pauses, "SLOW_COLLECTION_S", 0.0)  # every collection is "slow" here
        gc_pauses.watch_pauses()
        gc_pauses.watch_pauses()  # once per process, however often asked
        assert sum(isinstance(cb, gc_pauses._Timer) for cb in gc.callbacks) == 1
        with caplog.at_level(logging.WARNING, logger=gc_pauses.__name__):
            gc.collect()
        assert any("garbage collection of generation 2 paused" in r.message for r in caplog.records)
    finally:
        gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, gc_pauses._Timer)]
        gc.unfreeze()
