"""The KV store's bulk data channel: framed binary messages over one TCP
connection, outside gRPC and protobuf, so a block's bytes are written
straight from the sender's buffer and read straight into the receiver's.

gRPC stays the control plane (Exists, Delete, Stats, health); the store says
in Stats which port this channel listens on. A connection carries one call at
a time; a client keeps several connections for calls in parallel.

Request: the header REQUEST (magic, op, key count), then each key as a u16
length and its UTF-8 bytes; PUT then sends each value as a u64 length and its
bytes. Little endian throughout.
A reply starts with a status byte. OK (0) is followed by:
  PUT    -> u32 stored, u32 refused (larger than the store's capacity);
  GET    -> per key: i64 length (-1: missing), then that many bytes;
  EXISTS -> one byte per key (1 present, 0 missing).

Where the store can map the client's shared-memory arena (shared_arena.py),
values skip the socket:
  ATTACH      keys: [the segment's name], then a u64 arena size and the
              token -> OK (nothing more), or FAILED: use PUT and GET;
  PUT_SHARED  after the keys, per key a SPAN (u64 offset, u64 length) in the
              arena -> as PUT; the store copies the values out of the arena;
  GET_SHARED  after the keys, per key a SPAN -> one byte per key (1: copied
              into its span, 0: missing or of another length).
A connection's attachment lasts as long as the connection.

Where the engine can map the store's own slabs (value_slabs.py, shared=True;
same host and /dev/shm), a block moves between its GPU and a slot of the
store with no copy in between (lent_slots.py is the client):
  SLABS    no keys -> the store's token (16 bytes), a u8 state (SLABS_*:
           growing as values arrive, allocating all of its capacity now, or
           complete), a u32 count, then per slab a u32 index, u64 size and
           u16-length name;
  RESERVE  after the keys, per key a u64 length -> per key a PLACE (i32 slab,
           -1: none to lend, then u64 offset): a slot the client fills,
           invisible to every reader until committed;
  COMMIT   keys this connection reserved -> as PUT: each becomes that key's
           value, whole;
  PIN      after the keys, per key a u64 length -> per key a PLACE (-1:
           missing, another length, or not in a shared slab): the slot's
           value stays there, unchanged, while pinned (counts as a get);
  RELEASE  keys -> OK: this connection's reservations and pins of them end.
A connection's reservations and pins end with it.
FAILED (1), an error the store can name (its backend unreachable), is
followed by a u32 length and a UTF-8 message; the connection stays usable.
"""
from __future__ import annotations

import socket
import ssl
import struct
from typing import Sequence

from tandem.services.kvstore import held_gil_io

MAGIC = b"TKVD"
OP_PUT, OP_GET, OP_EXISTS, OP_ATTACH, OP_PUT_SHARED, OP_GET_SHARED = 1, 2, 3, 4, 5, 6
OP_SLABS, OP_RESERVE, OP_COMMIT, OP_PIN, OP_RELEASE = 7, 8, 9, 10, 11
OPS = {OP_PUT: "put", OP_GET: "get", OP_EXISTS: "exists", OP_ATTACH: "attach",
       OP_PUT_SHARED: "put (shared memory)", OP_GET_SHARED: "get (shared memory)",
       OP_SLABS: "slabs", OP_RESERVE: "reserve", OP_COMMIT: "commit", OP_PIN: "pin", OP_RELEASE: "release"}
REQUEST = struct.Struct("<4sBI")  # magic, op, number of keys
OK, FAILED = b"\x00", b"\x01"
MESSAGE_LEN = struct.Struct("<I")
KEY_LEN = struct.Struct("<H")
VALUE_LEN = struct.Struct("<Q")
FOUND_LEN = struct.Struct("<q")
PUT_REPLY = struct.Struct("<II")
SPAN = struct.Struct("<QQ")  # offset, length in the client's arena
PLACE = struct.Struct("<iQ")  # a store slot: slab index (-1: none), offset in the slab
SLAB = struct.Struct("<IQH")  # slab index, bytes, name length
COUNT = struct.Struct("<I")
SLABS_GROWING, SLABS_ALLOCATING, SLABS_COMPLETE = 0, 1, 2
MAX_KEYS = 1 << 16  # per call: a request larger than this is refused as malformed
MAX_KEY_BYTES = 1024


class ProtocolError(ValueError):
    """The peer sent bytes that are not this protocol (or closed mid-message)."""


def encode_keys(keys: Sequence[str]) -> bytes:
    parts = []
    for key in keys:
        raw = key.encode()
        if not raw or len(raw) > MAX_KEY_BYTES:
            raise ValueError(f"KV store keys must be 1 to {MAX_KEY_BYTES} bytes, got {len(raw)}")
        parts.append(KEY_LEN.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def request_header(op: int, keys: Sequence[str]) -> bytes:
    return REQUEST.pack(MAGIC, op, len(keys)) + encode_keys(keys)


# Reads up to this size first take what has come with the GIL held
# (held_gil_io): a header is a few bytes, copied in microseconds.
HELD_READ_MAX = 1 << 16
# Buffers per sendmsg (Linux's IOV_MAX is 1024).
MAX_BUFFERS = 1024


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (recv_into: the bytes land in place, and the
    call waits without the GIL). A small read takes what has come without
    letting the GIL go; the rest is one MSG_WAITALL read where the socket
    allows it (one GIL release, not one per piece the kernel has ready)."""
    got, size = 0, len(view)
    if 0 < size <= HELD_READ_MAX:
        n = held_gil_io.recv_now(sock, view)
        if n == 0:
            raise ProtocolError(f"the peer closed the connection after 0 of {size} bytes")
        got = n or 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got, flags)
        except BlockingIOError as exc:  # SO_RCVTIMEO ran out (wait_in_kernel)
            raise TimeoutError(f"timed out after {got} of {size} bytes") from exc
        if n == 0:
            raise ProtocolError(f"the peer closed the connection after {got} of {size} bytes")
        got += n


def send_buffers(sock: socket.socket, buffers: Sequence) -> None:
    """Every buffer, in order, in as few sendmsg calls as the kernel takes
    (each lets the GIL go once; a sendall per buffer would twice a value)."""
    if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg
        for buffer in buffers:
            sock.sendall(buffer)
        return
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    first = 0
    while first < len(pending):
        try:
            sent = sock.sendmsg(pending[first:first + MAX_BUFFERS])
        except BlockingIOError as exc:  # SO_SNDTIMEO ran out (wait_in_kernel)
            raise TimeoutError("timed out sending to the KV store") from exc
        first = _past(pending, first, sent)


def recv_into_buffers(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, in order: one recvmsg_into with MSG_WAITALL where the
    socket allows (one GIL release for a value and the header after it)."""
    if isinstance(sock, ssl.SSLSocket):  # TLS has no recvmsg
        for view in views:
            recv_exactly_into(sock, view)
        return
    pending = [view for view in views if len(view)]
    first = 0
    while first < len(pending):
        try:
            got = sock.recvmsg_into(pending[first:first + MAX_BUFFERS], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError as exc:  # SO_RCVTIMEO ran out (wait_in_kernel)
            raise TimeoutError("timed out waiting for the KV store") from exc
        if got == 0:
            raise ProtocolError("the peer closed the connection mid-reply")
        first = _past(pending, first, got)


def _past(pending: list[memoryview], first: int, done: int) -> int:
    """The first of `pending` not yet whole after `done` more bytes went (the
    partly done one is cut to its rest)."""
    while done:
        if done >= len(pending[first]):
            done -= len(pending[first])
            first += 1
        else:
            pending[first] = pending[first][done:]
            done = 0
    return first


def recv_exactly(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    recv_exactly_into(sock, memoryview(buf))
    return buf


def recv_struct(sock: socket.socket, fmt: struct.Struct) -> tuple:
    return fmt.unpack(recv_exactly(sock, fmt.size))


def read_request(sock: socket.socket) -> tuple[int, list[str]]:
    """(op, keys) of the next request; ProtocolError on anything else."""
    magic, op, count = recv_struct(sock, REQUEST)
    if magic != MAGIC or op not in OPS:
        raise ProtocolError(f"not a tandem KV data request (magic {magic!r}, op {op})")
    if count > MAX_KEYS:
        raise ProtocolError(f"{count} keys in one request; the limit is {MAX_KEYS}")
    keys = []
    for _ in range(count):
        (length,) = recv_struct(sock, KEY_LEN)
        if not 0 < length <= MAX_KEY_BYTES:
            raise ProtocolError(f"a key of {length} bytes; keys are 1 to {MAX_KEY_BYTES}")
        keys.append(recv_exactly(sock, length).decode())
    return op, keys


def encode_spans(items: Sequence[tuple[str, int, int]]) -> bytes:
    return b"".join(SPAN.pack(offset, length) for _, offset, length in items)


def read_spans(sock: socket.socket, count: int) -> list[tuple[int, int]]:
    raw = recv_exactly(sock, SPAN.size * count)
    return [SPAN.unpack_from(raw, i * SPAN.size) for i in range(count)]


def encode_lengths(lengths: Sequence[int]) -> bytes:
    return b"".join(VALUE_LEN.pack(n) for n in lengths)


def read_lengths(sock: socket.socket, count: int) -> list[int]:
    raw = recv_exactly(sock, VALUE_LEN.size * count)
    return [VALUE_LEN.unpack_from(raw, i * VALUE_LEN.size)[0] for i in range(count)]


def encode_places(places: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(PLACE.pack(slab, offset) for slab, offset in places)


def decode_places(raw) -> list[tuple[int, int]]:
    return list(PLACE.iter_unpack(raw))


def send_failed(sock: socket.socket, message: str) -> None:
    raw = message.encode()
    sock.sendall(FAILED + MESSAGE_LEN.pack(len(raw)) + raw)


def wait_in_kernel(sock: socket.socket, timeout_s: float) -> None:
    """The deadline of a data-channel socket: in the kernel on a plain socket
    (held_gil_io.kernel_deadline: a read is one system call, not a poll and a
    read, each letting the GIL go), in Python on a TLS one (its reads are not
    one system call anyway)."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(timeout_s)
    else:
        held_gil_io.kernel_deadline(sock, timeout_s)


def read_reply(sock: socket.socket, size: int) -> memoryview:
    """A reply's status and its `size` bytes of fixed body, in one recv where
    the store wrote them in one send (it does); raises RemoteError on FAILED.
    Never reads past the reply: a GET's values follow on the same connection."""
    buf = bytearray(1 + size)
    view = memoryview(buf)
    got = _recv_some(sock, view)
    if view[0:1] == FAILED:
        head = bytearray(view[1:min(got, 1 + MESSAGE_LEN.size)])
        head += recv_exactly(sock, MESSAGE_LEN.size - len(head))
        (length,) = MESSAGE_LEN.unpack(head)
        message = bytearray(view[1 + MESSAGE_LEN.size:got])[:length]
        message += recv_exactly(sock, length - len(message))
        raise RemoteError(message.decode(errors="replace"))
    if view[0:1] != OK:
        raise ProtocolError(f"not a tandem KV data reply (status byte {bytes(view[0:1])!r})")
    if got < len(view):
        recv_exactly_into(sock, view[got:])
    return view[1:]


def _recv_some(sock: socket.socket, view: memoryview) -> int:
    """At least one byte into `view` (as many as have come, up to its length);
    the GIL goes only if the reply has not come yet (held_gil_io)."""
    try:
        n = held_gil_io.recv_some(sock, view)
    except BlockingIOError as exc:  # SO_RCVTIMEO ran out (wait_in_kernel)
        raise TimeoutError("timed out waiting for the KV store's reply") from exc
    if n == 0:
        raise ProtocolError("the peer closed the connection before replying")
    return n


def read_status(sock: socket.socket) -> None:
    """The reply's status byte: returns on OK, raises RemoteError on FAILED
    (a reply with no fixed body: read_reply's)."""
    read_reply(sock, 0)


class RemoteError(RuntimeError):
    """The store answered with an error it could name (its backend unreachable)."""
