"""The Redis backend's command packer: RESP framing, and large values sent
from the caller's buffer, never copied."""
from __future__ import annotations

import pytest

from tandem.services.kvstore.redis_wire import LARGE_ARG_BYTES, BulkValuePacker


def joined(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def test_small_commands_are_one_piece_of_resp():
    pieces = BulkValuePacker().pack("GET", "model/1/0")
    assert pieces == [b"*2\r\n$3\r\nGET\r\n$9\r\nmodel/1/0\r\n"]


def test_multi_word_command_names_become_separate_arguments():
    assert joined(BulkValuePacker().pack("CLIENT SETNAME", "x", 5)) == (
        b"*4\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$1\r\nx\r\n$1\r\n5\r\n")


def test_a_large_value_is_a_piece_of_its_own_on_the_callers_buffer():
    value = bytearray(b"v" * (LARGE_ARG_BYTES + 1))
    pieces = BulkValuePacker().pack("SET", "k", value)
    assert len(pieces) == 3
    assert isinstance(pieces[1], memoryview) and pieces[1].obj is value  # not a copy
    assert joined(pieces) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n" % (len(value), bytes(value))


def test_a_memoryview_of_wider_items_is_framed_by_its_bytes():
    import array

    view = memoryview(array.array("I", range(10_000)))
    pieces = BulkValuePacker().pack("SET", "k", view)
    assert b"$40000\r\n" in pieces[0] and pieces[1].nbytes == len(pieces[1]) == 40_000


def test_arguments_redis_cannot_take_are_refused():
    with pytest.raises(TypeError):
        BulkValuePacker().pack("SET", "k", True)
    with pytest.raises(TypeError):
        BulkValuePacker().pack("SET", "k", object())
