"""How the Redis backend writes commands: a command packer for redis-py's
connections that never copies a large value.

redis-py, when hiredis is installed, packs every command with
`hiredis.pack_command`, which turns a memoryview or bytearray into bytes
first and then copies all of it again into one packed string, holding the
GIL: about 3 ms per 2 MiB block on the dev machine, an eighth of the
loopback's speed. This packer emits a large value as a piece of its own
(redis-py sends the pieces one after another with sendall), so its bytes go
from the caller's buffer straight to the socket.

The wire format is RESP's array of bulk strings: `*<n>\\r\\n`, then per
argument `$<length>\\r\\n<bytes>\\r\\n`.
"""
from __future__ import annotations

from typing import Union

# Arguments longer than this are sent as pieces of their own; shorter ones
# are joined with the framing around them (one sendall for a whole GET).
LARGE_ARG_BYTES = 16 * 1024

Piece = Union[bytes, memoryview]


def encode_arg(arg) -> Union[bytes, bytearray, memoryview]:
    """An argument's bytes: str as UTF-8, numbers as their decimal text."""
    if isinstance(arg, (bytes, bytearray)):
        return arg
    if isinstance(arg, memoryview):
        return arg if arg.format == "B" and arg.ndim == 1 else arg.cast("B")  # len() in bytes
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):  # a bool is an int: refuse it rather than send "True"
        raise TypeError("a Redis argument cannot be a bool")
    if isinstance(arg, (int, float)):
        return repr(arg).encode()
    raise TypeError(f"a Redis argument cannot be a {type(arg).__name__}")


class BulkValuePacker:
    """A `command_packer` for redis-py's Connection: pack(*args) -> pieces to send."""

    def pack(self, *args) -> list[Piece]:
        # redis-py passes multi-word command names as one argument ("CLIENT SETINFO"):
        # Redis wants each word as an argument of its own.
        first = args[0].encode() if isinstance(args[0], str) else bytes(args[0])
        args = (*first.split(), *args[1:])
        pieces: list[Piece] = []
        head = bytearray(b"*%d\r\n" % len(args))
        for arg in args:
            raw = encode_arg(arg)
            head += b"$%d\r\n" % len(raw)
            if len(raw) > LARGE_ARG_BYTES:
                pieces.append(bytes(head))
                # A memoryview: redis-py sends it as is, never joined with other pieces.
                pieces.append(raw if isinstance(raw, memoryview) else memoryview(raw))
                head = bytearray(b"\r\n")
            else:
                head += raw
                head += b"\r\n"
        pieces.append(bytes(head))
        return pieces
