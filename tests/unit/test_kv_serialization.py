"""KV blocks as bytes: a staged block carries a header naming its dtype and
shape; a slot written by an engine of another dtype, block size or model
shape is refused, never misread; slots are handed out as contiguous runs
and come back merged."""
from __future__ import annotations

import pytest
import torch

from tandem.engine.connector.base import KVCacheLayout
from tandem.engine.connector.staging import StagingArena


def layout(dtype=torch.float32, block_size=16, layers=3, heads=2, dim=8) -> KVCacheLayout:
    return KVCacheLayout(layers, 64, block_size, heads, dim, dtype, torch.device("cpu"), model_key="m")


def arena(lay: KVCacheLayout, slots: int = 8, memory=None) -> StagingArena:
    return StagingArena(memory or memoryview(bytearray(slots * StagingArena.slot_size(lay))), lay)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_staged_block_reads_back_bit_for_bit_with_its_header(dtype):
    a = arena(layout(dtype))
    start = a.alloc(3)
    blocks = torch.randn(3, *a.block_shape).to(dtype)
    a.blocks[start:start + 3] = blocks
    a.write_headers(start, 3)
    assert a.headers_ok(start, 3)
    assert torch.equal(a.blocks[start:start + 3].view(torch.uint8), blocks.view(torch.uint8))
    # Where put/get move it: one value per block, header and every layer.
    (_, offset, length), *_ = a.items(["k0", "k1", "k2"], start)
    assert offset == start * a.slot_bytes and length == 64 + a.layout.block_bytes


@pytest.mark.parametrize("other", [layout(torch.float16), layout(block_size=32), layout(layers=4)])
def test_a_block_of_another_layout_is_refused(other):
    ours, theirs = layout(), other
    memory = memoryview(bytearray(4 * max(StagingArena.slot_size(ours), StagingArena.slot_size(theirs))))
    writer = arena(theirs, memory=memory)
    writer.write_headers(0, 1)
    reader = arena(ours, memory=memory)
    assert not reader.headers_ok(0, 1)


def test_slots_come_back_merged_and_a_full_arena_says_so():
    a = arena(layout(), slots=6)
    first, second = a.alloc(4), a.alloc(2)
    assert (first, second) == (0, 4) and a.alloc(1) is None
    a.free(first, 4)
    assert a.alloc(5) is None  # 4 free, not 5
    a.free(second, 2)
    assert a.num_free == 6 and a.alloc(6) == 0


def test_an_allocation_may_leave_slots_for_others():
    # Prefetches leave room for a step's saves: they take nothing that would
    # leave fewer than keep_free slots.
    a = arena(layout(), slots=8)
    assert a.alloc(5, keep_free=4) is None and a.num_free == 8
    assert a.alloc(4, keep_free=4) == 0 and a.alloc(4) == 4


def test_an_allocation_waits_for_slots_that_are_still_in_use():
    """A step's saves wait for the slots earlier puts still hold (they come back
    as each put lands), even when fewer than they need are free right now."""
    import threading
    import time

    a = arena(layout(), slots=8)
    held = a.alloc(6)  # an earlier step's saves, still being put
    threading.Timer(0.2, a.free, args=(held, 6)).start()
    started = time.monotonic()
    assert a.alloc(7, wait_s=5.0) == 0
    assert 0.15 < time.monotonic() - started < 4.0
    assert a.alloc(2, wait_s=0.1) is None  # and gives up after wait_s
