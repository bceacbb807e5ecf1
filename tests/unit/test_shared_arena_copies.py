"""The store's view of an engine's shared-memory arena: values are copied out
of and into their spans, whatever the order of the spans or the gaps between
them, from writable buffers and from bytes; bytes outside the spans are left
alone, spans outside the arena refused, and a buffer of another length than
its span is an error, not a partial copy."""
from __future__ import annotations

import os

import pytest

from tandem.services.kvstore.shared_arena import AttachedArena, SharedArena

SIZE = 64 * 1024


@pytest.fixture
def arenas():
    owner = SharedArena(SIZE)
    owner.view[:] = os.urandom(SIZE)
    attached = AttachedArena(owner.name, owner.token, SIZE)
    yield owner, attached
    attached.close()
    owner.close()


SPAN_SETS = {
    "consecutive": [(i * 1000, 1000) for i in range(10)],
    "slot padding": [(i * 1100, 1000) for i in range(10)],
    "out of order": [(5000, 700), (0, 1000), (9000, 300), (1000, 500)],
    "far apart": [(0, 100), (20_000, 100), (60_000, 4000)],
    "empty span": [(0, 10), (10, 0), (10, 10)],
}


@pytest.mark.parametrize("name", SPAN_SETS)
def test_read_into_takes_each_span_into_its_buffer(arenas, name):
    owner, attached = arenas
    spans = SPAN_SETS[name]
    buffers = [bytearray(length) for _, length in spans]
    attached.read_into(buffers, spans)
    for buffer, (offset, length) in zip(buffers, spans):
        assert bytes(buffer) == bytes(owner.view[offset:offset + length])


@pytest.mark.parametrize("name", SPAN_SETS)
@pytest.mark.parametrize("kind", [bytearray, bytes])
def test_write_from_puts_each_value_at_its_span_and_nothing_else(arenas, name, kind):
    owner, attached = arenas
    spans = SPAN_SETS[name]
    expected = bytearray(owner.view)
    values = [kind(os.urandom(length)) for _, length in spans]
    attached.write_from(values, spans)
    for value, (offset, length) in zip(values, spans):
        expected[offset:offset + length] = value
    assert bytes(owner.view) == bytes(expected)


def test_a_buffer_of_another_length_is_refused(arenas):
    _, attached = arenas
    with pytest.raises(ValueError, match="span"):
        attached.read_into([bytearray(10)], [(0, 11)])
    with pytest.raises(ValueError, match="span"):
        attached.write_from([b"x" * 12], [(0, 11)])


def test_spans_outside_the_arena_are_refused(arenas):
    _, attached = arenas
    with pytest.raises(ValueError, match="outside"):
        attached.check([(0, 10), (SIZE - 5, 10)])
    with pytest.raises(ValueError, match="outside"):
        attached.check([(-1, 10)])
