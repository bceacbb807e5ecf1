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

from typing import Optional, Union

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


# --- replies ---------------------------------------------------------------------------------

# Bytes asked of the socket while looking for a reply's header line: small,
# so little of the value behind it lands in the header buffer (and is copied
# once more from there).
HEADER_READ_BYTES = 4096


class ReplyError(Exception):
    """Redis answered a command with an error reply (`-ERR ...`)."""


class ProtocolError(Exception):
    """Redis sent something that is not a bulk-string reply."""


class BulkReplyReader:
    """Reads replies of bulk-string commands (GET) from a socket, each value
    straight into a buffer of its own size: one copy out of the kernel.

    redis-py's hiredis parser copies a value three times (into its read
    buffer, into the reader's, into a new bytes object), two of them under
    the GIL, and slows down further on several large replies in a row.
    """

    def __init__(self, sock) -> None:
        self._sock = sock
        self._pending = bytearray()  # bytes received past the last reply read

    def _fill(self, least: int) -> None:
        while len(self._pending) < least:
            chunk = self._sock.recv(HEADER_READ_BYTES)
            if not chunk:
                raise ConnectionError("Redis closed the connection mid-reply")
            self._pending += chunk

    def _line(self) -> bytes:
        start = 0
        while True:
            end = self._pending.find(b"\r\n", start)
            if end >= 0:
                line = bytes(self._pending[:end])
                del self._pending[:end + 2]
                return line
            start = max(len(self._pending) - 1, 0)
            self._fill(len(self._pending) + 1)

    def read(self, buffer_for) -> Optional[bytearray]:
        """The next reply: a bulk string's bytes in buffer_for(length), or None for a nil.
        ReplyError for an error reply (the connection stays in step)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        if kind == b"_":  # RESP3's null (redis-py speaks RESP3 to a Redis that has it)
            return None
        if kind != b"$":
            raise ProtocolError(f"expected a bulk string, got {line[:40]!r}")
        length = int(rest)
        if length < 0:
            return None
        buffer = buffer_for(length)
        view = memoryview(buffer)
        have = min(len(self._pending), length)
        view[:have] = self._pending[:have]
        del self._pending[:have]
        got = have
        while got < length:
            n = self._sock.recv_into(view[got:], length - got)
            if n == 0:
                raise ConnectionError("Redis closed the connection mid-value")
            got += n
        self._fill(2)
        if self._pending[:2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        del self._pending[:2]
        return buffer

    @property
    def drained(self) -> bool:
        """Nothing received beyond the replies read (the connection can serve others)."""
        return not self._pending
