"""Suite-wide hooks."""
from __future__ import annotations

import gc
import os

import pytest

from tests.lanes import LANE_ENV
from tests.support.memory import resident_bytes

# A test that leaves this process this much larger than after the last
# collection has its garbage collected at once (an engine is about 1.5 GB).
COLLECT_AFTER_GROWTH_BYTES = 2**30

_resident_after_collect = 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Collect garbage once a module's fixtures are finalized, and after a test
    that grew this process by COLLECT_AFTER_GROWTH_BYTES. An engine (LLM) lives
    in reference cycles, so it outlived its test or module until the
    interpreter's next full collection, often many engines later: the process
    running the suite held up to 16.8 GB of a 24 GiB machine, beside the
    stacks' engines. Not after every test: a collection walks the whole heap
    (0.2-0.3 s with an engine loaded), and most tests make no engine."""
    global _resident_after_collect
    result = yield
    if (nextitem is None or nextitem.module is not item.module
            or resident_bytes() > _resident_after_collect + COLLECT_AFTER_GROWTH_BYTES):
        gc.collect()
        _resident_after_collect = resident_bytes()
    return result


def pytest_collection_modifyitems(config, items):
    """Under tests/lanes.py: "shared" while the two lanes run side by side
    (solo tests left out), "solo" for the short run after them (only those)."""
    lane = os.environ.get(LANE_ENV)
    if lane not in ("shared", "solo"):
        return
    keep = [item for item in items if (item.get_closest_marker("solo") is not None) == (lane == "solo")]
    kept = set(keep)
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = keep
