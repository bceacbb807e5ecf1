"""The engine's KV store (engine.connector.base.KVStore) on tandem's KV store
service: block values, and the lookups a transfer makes (exists), over the
store's bulk data channel (data_wire.py), straight between the arena and the
socket; gRPC for finding that channel (Stats).

The store says in Stats which port its data channel listens on (same host as
its gRPC address). The client keeps a few connections and gives each call
one of them, so a prefetch and a save move bytes at once. Any failure closes
that connection and raises KVStoreUnavailable (the connector recomputes);
the next call connects again, asking Stats anew (a restarted store may listen
elsewhere). A store without a data channel (--data-port -1) is used through
gRPC Put and Get instead, copying each value.

When the arena is shared memory (`shared`, set by the mover) and the store
can map it (same host and /dev/shm), each connection attaches it and values
move as offsets: the store copies them in and out of the arena itself.
"""
from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from typing import Optional, Sequence

from tandem.services.common.grpc_server import TLSConfig
from tandem.services.kvstore import data_wire as wire
from tandem.services.kvstore import held_gil_io
from tandem.services.kvstore.client import KVStoreClient, KVStoreUnavailable
from tandem.services.kvstore.data_server import tune

log = logging.getLogger(__name__)

# Connections kept for lookups (exists) beside those that move values: a
# decode's lookups and its waits for a prefill's writes must not queue behind
# whole loads (measured: 42 ms a lookup when they shared the same four).
LOOKUP_CONNECTIONS = 2


class BlockStoreClient:
    def __init__(self, target: str, timeout_s: float = 5.0, tls: Optional[TLSConfig] = None,
                 connections: int = 4) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.control = KVStoreClient(target, timeout_s=timeout_s, tls=tls)
        self.tls = tls
        self._host = target.rpartition(":")[0].strip("[]")
        self._ssl = _client_ssl_context(tls)
        self._idle: queue.LifoQueue[socket.socket] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(connections)
        self._lookup_idle: queue.LifoQueue[socket.socket] = queue.LifoQueue()
        self._lookup_slots = threading.BoundedSemaphore(LOOKUP_CONNECTIONS)
        self._data_port: Optional[int] = None
        self.arena: Optional[memoryview] = None
        # The arena's shared-memory segment (name, token), when it is one the
        # store may attach; None: values always go through the socket.
        self.shared: Optional[tuple[str, bytes]] = None
        self._attached: set[socket.socket] = set()  # connections whose store mapped the arena
        self._said_unshared = False

    # ---- KVStore -----------------------------------------------------------
    def open_arena(self, nbytes: int) -> memoryview:
        self.arena = memoryview(bytearray(nbytes))
        return self.arena

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # On the data channel when there is one: a decode asks while its
        # prefill's puts land, and a busy store answers a connection's thread
        # sooner than its gRPC thread pool (measured: 28 ms per lookup through gRPC).
        if not keys:
            return []
        if self._port() == 0:
            return self.control.exists(keys)
        with self._connection("exists", lookup=True) as sock:
            held_gil_io.sendall(sock, wire.request_header(wire.OP_EXISTS, list(keys)))
            return [b == 1 for b in wire.read_reply(sock, len(keys))]

    def put(self, items: Sequence[tuple[str, int, int]]) -> int:
        if not items:
            return 0
        self._check_spans(items)
        port = self._port()
        if port == 0:
            return self.control.put([(key, bytes(self.arena[o:o + n])) for key, o, n in items])
        with self._connection("put") as sock:
            if sock in self._attached:
                held_gil_io.sendall(sock, wire.request_header(wire.OP_PUT_SHARED, [key for key, _, _ in items])
                                    + wire.encode_spans(items))
                stored, _refused = wire.PUT_REPLY.unpack(wire.read_reply(sock, wire.PUT_REPLY.size))
                return stored
            parts = [wire.request_header(wire.OP_PUT, [key for key, _, _ in items])]
            for _, offset, length in items:
                parts += [wire.VALUE_LEN.pack(length), self.arena[offset:offset + length]]
            wire.send_buffers(sock, parts)
            stored, _refused = wire.PUT_REPLY.unpack(wire.read_reply(sock, wire.PUT_REPLY.size))
            return stored

    def get(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        if not items:
            return []
        self._check_spans(items)
        port = self._port()
        if port == 0:
            return self._get_over_grpc(items)
        found = []
        with self._connection("get") as sock:
            if sock in self._attached:
                held_gil_io.sendall(sock, wire.request_header(wire.OP_GET_SHARED, [key for key, _, _ in items])
                                    + wire.encode_spans(items))
                return [b == 1 for b in wire.read_reply(sock, len(items))]
            held_gil_io.sendall(sock, wire.request_header(wire.OP_GET, [key for key, _, _ in items]))
            # The status and the first value's length in one read; then each
            # value with the next one's length in one read.
            header = memoryview(bytearray(wire.FOUND_LEN.size))
            header[:] = wire.read_reply(sock, wire.FOUND_LEN.size)
            for i, (_, offset, length) in enumerate(items):
                (size,) = wire.FOUND_LEN.unpack(header)
                parts = [] if size < 0 else [self.arena[offset:offset + length] if size == length
                                             else memoryview(bytearray(size))]  # another layout's: read past it
                if i + 1 < len(items):
                    parts.append(header)
                wire.recv_into_buffers(sock, parts)
                found.append(size == length)
        return found

    def _check_spans(self, items: Sequence[tuple[str, int, int]]) -> None:
        size = len(self.arena)
        for key, offset, length in items:
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(f"{key}: bytes {offset}..{offset + length} are outside the {size}-byte arena")

    def _get_over_grpc(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        values = self.control.get([key for key, _, _ in items])
        found = []
        for (_, offset, length), value in zip(items, values):
            ok = value is not None and len(value) == length
            if ok:
                self.arena[offset:offset + length] = value
            found.append(ok)
        return found

    def lent_slots(self, pin_memory=None, unpin_memory=None, observe=None):
        """The store's own slots, where it lends them (engine.connector.base.StoreSlots)."""
        from tandem.services.kvstore.lent_slots import LentSlots

        return LentSlots(self.target, self.timeout_s, self.tls, pin_memory=pin_memory, unpin_memory=unpin_memory,
                          observe=observe)

    def close(self) -> None:
        for idle in (self._idle, self._lookup_idle):
            while True:
                try:
                    self._forget(idle.get_nowait())
                except queue.Empty:
                    break
        self.control.close()

    # ---- connections -------------------------------------------------------
    def _port(self) -> int:
        """The data channel's port (0: the store has none), asked of the store once per connection loss."""
        if self._data_port is None:
            self._data_port = self.control.stats().data_port
        return self._data_port

    def _connection(self, op: str, lookup: bool = False) -> "_Borrowed":
        """A connection for one call: one of the lookup connections, or of those that move values."""
        if lookup:
            return _Borrowed(self, op, self._lookup_slots, self._lookup_idle)
        return _Borrowed(self, op, self._slots, self._idle)

    def _connect(self, attach: bool = True) -> socket.socket:
        sock = socket.create_connection((self._host, self._port()), timeout=self.timeout_s)
        tune(sock)
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(sock, server_hostname=self._host)
        wire.wait_in_kernel(sock, self.timeout_s)  # once: settimeout itself lets the GIL go
        if self.shared is not None and attach:
            self._attach(sock)
        return sock

    def _attach(self, sock: socket.socket) -> None:
        """Offer the store our shared arena; it maps it or says why not."""
        name, token = self.shared
        sock.sendall(wire.request_header(wire.OP_ATTACH, [name]) + wire.VALUE_LEN.pack(len(self.arena)) + token)
        try:
            wire.read_status(sock)
        except wire.RemoteError as exc:
            if not self._said_unshared:
                self._said_unshared = True
                log.info("KV store at %s cannot map this engine's arena (%s): values go over its data channel",
                         self.target, exc)
            return
        self._attached.add(sock)

    def _forget(self, sock: socket.socket) -> None:
        self._attached.discard(sock)
        sock.close()


class _Borrowed:
    """One call's connection: an idle one or a new one; back to the idle ones
    after a clean call, closed (and the port asked again) after a failure."""

    def __init__(self, client: BlockStoreClient, op: str, slots: threading.BoundedSemaphore,
                 idle: "queue.LifoQueue[socket.socket]") -> None:
        self.client = client
        self.op = op
        self.slots, self.idle = slots, idle
        self.sock: Optional[socket.socket] = None

    def __enter__(self) -> socket.socket:
        client = self.client
        if not self.slots.acquire(timeout=client.timeout_s):
            raise KVStoreUnavailable(f"KV store at {client.target}: {self.op} found every connection busy "
                                     f"for {client.timeout_s:g}s")
        try:
            try:
                self.sock = self.idle.get_nowait()
            except queue.Empty:
                self.sock = client._connect(attach=self.idle is client._idle)  # lookups move no values
        except (OSError, ssl.SSLError, wire.ProtocolError) as exc:
            self.slots.release()
            client._data_port = None
            raise KVStoreUnavailable(f"KV store at {client.target}: cannot open its data channel: {exc}") from exc
        self.started = time.monotonic()
        return self.sock

    def __exit__(self, kind, exc, tb) -> bool:
        client = self.client
        try:
            if kind is None:
                self.idle.put(self.sock)
                return False
            client._forget(self.sock)
            client._data_port = None
            if isinstance(exc, wire.RemoteError):
                raise KVStoreUnavailable(f"KV store at {client.target}: {self.op} failed: {exc}") from exc
            if isinstance(exc, (OSError, ssl.SSLError, wire.ProtocolError)):
                raise KVStoreUnavailable(f"KV store at {client.target}: {self.op} over the data channel "
                                         f"failed after {time.monotonic() - self.started:.1f}s: {exc}") from exc
            return False
        finally:
            self.slots.release()


def _client_ssl_context(tls: Optional[TLSConfig]) -> Optional[ssl.SSLContext]:
    """TLS to the data channel when the role talks TLS to other roles (a CA given),
    showing its certificate as a client certificate when it has one."""
    if not (tls and tls.ca_file):
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    if tls.cert_file and tls.key_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context
