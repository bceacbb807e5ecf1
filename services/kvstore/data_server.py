"""The KV store's bulk data channel, server side (data_wire.py has the format).

One thread per connection: it reads a request, moves the values between the
socket and the backend, answers, and reads the next. Values are received
into buffers of their own size (one copy, out of the kernel) and kept as
they are by the memory backend; they are sent from the backend's own bytes.
Socket calls wait without the GIL, so connections proceed side by side.
"""
from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
from typing import Optional

from tandem.services.kvstore import data_wire as wire
from tandem.services.kvstore.backends import Backend, BackendUnavailable

log = logging.getLogger(__name__)

# A PUT hands values to the backend in batches of about this many bytes.
PUT_FLUSH_BYTES = 16 * 1024 * 1024
# Keys per backend.get inside one GET: bounds the values held at once.
GET_BATCH_KEYS = 16
SOCKET_BUFFER_BYTES = 8 * 1024 * 1024
_END = object()  # the end of a backend's iter_get


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def setup(self) -> None:
        # Receive buffers of this connection, for backends that do not keep
        # them (Redis has its own copy once put returns): size -> free buffers.
        self._spare: dict[int, list[bytearray]] = {}
        tune(self.request)
        if self.server.ssl_context is not None:
            self.request = self.server.ssl_context.wrap_socket(self.request, server_side=True)

    def handle(self) -> None:
        sock = self.request
        while True:
            try:
                op, keys = wire.read_request(sock)
            except wire.ProtocolError as exc:
                if "closed the connection after 0 of" not in str(exc):
                    log.warning("data channel: dropping a connection from %s: %s", self.client_address, exc)
                return
            except (OSError, ssl.SSLError):
                return
            try:
                if op == wire.OP_PUT:
                    self._put(sock, keys)
                elif op == wire.OP_GET:
                    self._get(sock, keys)
                else:
                    self._exists(sock, keys)
            except (OSError, ssl.SSLError, wire.ProtocolError) as exc:
                log.info("data channel: connection from %s ended during %s: %s", self.client_address,
                         wire.OPS[op], exc)
                return

    def _put(self, sock: socket.socket, keys: list[str]) -> None:
        backend, metrics = self.server.backend, self.server.metrics
        stored = refused = 0
        failure: Optional[str] = None
        batch: list[tuple[str, bytearray]] = []
        batch_bytes = 0

        keeps = getattr(backend, "keeps_values", True)

        def flush() -> None:
            nonlocal stored, refused, batch, batch_bytes, failure
            if batch and failure is None:
                try:
                    results = backend.put(batch)
                except BackendUnavailable as exc:
                    failure = str(exc)
                else:
                    ok = sum(results)
                    stored += ok
                    refused += len(results) - ok
                    if metrics is not None:
                        metrics.on_put(ok, sum(len(v) for (_, v), r in zip(batch, results) if r))
            if not keeps:
                for _, value in batch:
                    self._spare.setdefault(len(value), []).append(value)
            batch, batch_bytes = [], 0

        for key in keys:
            (length,) = wire.recv_struct(sock, wire.VALUE_LEN)
            # Read even after a failure: the stream stays in step.
            value = self._buffer(length, keeps)
            wire.recv_exactly_into(sock, memoryview(value))
            if failure is None:
                batch.append((key, value))
                batch_bytes += length
                if batch_bytes >= PUT_FLUSH_BYTES:
                    flush()
        flush()
        if failure is not None:
            wire.send_failed(sock, failure)
        else:
            sock.sendall(wire.OK + wire.PUT_REPLY.pack(stored, refused))

    def _buffer(self, size: int, keeps: bool) -> bytearray:
        """A buffer to receive a value of `size` into: reused, not fresh (fresh
        memory costs a page fault per 4 KiB)."""
        if keeps:
            take = getattr(self.server.backend, "take_buffer", None)
            return take(size) if take is not None else bytearray(size)
        spare = self._spare.get(size)
        return spare.pop() if spare else bytearray(size)

    def _get(self, sock: socket.socket, keys: list[str]) -> None:
        backend, metrics = self.server.backend, self.server.metrics
        if hasattr(backend, "iter_get"):
            self._get_streamed(sock, keys)
            return
        for start in range(0, max(len(keys), 1), GET_BATCH_KEYS):
            batch = keys[start:start + GET_BATCH_KEYS]
            try:
                values = backend.get(batch) if batch else []
            except BackendUnavailable as exc:
                if start == 0:
                    wire.send_failed(sock, str(exc))
                    return
                raise wire.ProtocolError(f"the backend failed mid-reply: {exc}") from exc  # drop the connection
            if start == 0:
                sock.sendall(wire.OK)
            hits = 0
            for value in values:
                if value is None:
                    sock.sendall(wire.FOUND_LEN.pack(-1))
                    continue
                hits += 1
                sock.sendall(wire.FOUND_LEN.pack(len(value)))
                sock.sendall(value)
            if metrics is not None:
                metrics.on_get(hits, len(values) - hits, sum(len(v) for v in values if v is not None))

    def _get_streamed(self, sock: socket.socket, keys: list[str]) -> None:
        """A GET from a backend that reads values from elsewhere (Redis): each
        value is sent as soon as it is read, while the backend already waits on
        the next ones, then its buffer is handed back for the next read."""
        backend, metrics = self.server.backend, self.server.metrics
        values = backend.iter_get(keys)
        hits = misses = sent_bytes = 0
        try:
            try:
                value = next(values, _END)
            except BackendUnavailable as exc:
                wire.send_failed(sock, str(exc))
                return
            sock.sendall(wire.OK)
            while value is not _END:
                if value is None:
                    misses += 1
                    sock.sendall(wire.FOUND_LEN.pack(-1))
                else:
                    hits += 1
                    sent_bytes += len(value)
                    sock.sendall(wire.FOUND_LEN.pack(len(value)))
                    sock.sendall(value)
                    backend.release_values([value])
                try:
                    value = next(values, _END)
                except BackendUnavailable as exc:  # mid-reply: drop the connection
                    raise wire.ProtocolError(f"the backend failed mid-reply: {exc}") from exc
        finally:
            values.close()  # a send that failed leaves replies in flight: the backend drops them
            if metrics is not None and hits + misses:
                metrics.on_get(hits, misses, sent_bytes)

    def _exists(self, sock: socket.socket, keys: list[str]) -> None:
        try:
            present = self.server.backend.exists(keys)
        except BackendUnavailable as exc:
            wire.send_failed(sock, str(exc))
            return
        sock.sendall(wire.OK + bytes(bytearray(1 if p else 0 for p in present)))


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = False  # a taken port is an error at start, as for gRPC

    def __init__(self, address, backend: Backend, metrics, ssl_context) -> None:
        # metrics: on_put(stored, bytes) and on_get(hits, misses, bytes), as server.StoreMetrics has
        self.backend = backend
        self.metrics = metrics
        self.ssl_context = ssl_context
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address) -> None:
        # One line, not socketserver's traceback: e.g. a plaintext client of a TLS channel.
        import sys

        log.warning("data channel: a connection from %s failed: %s", client_address, sys.exc_info()[1])


class DataServer:
    """The data channel of a KV store, listening on host:port (0: a free port)."""

    def __init__(self, backend: Backend, host: str, port: int, metrics=None,
                 ssl_context: Optional[ssl.SSLContext] = None) -> None:
        self._server = _Server((host, port), backend, metrics, ssl_context)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvstore-data", daemon=True)

    def start(self) -> "DataServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def tune(sock: socket.socket) -> None:
    """Large socket buffers (fewer wake-ups per MiB) and no Nagle delay on the small replies."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def server_ssl_context(tls) -> Optional[ssl.SSLContext]:
    """TLS for the data channel from the role's TLSConfig (the same certificates
    as its gRPC server; client certificates required when a CA is given)."""
    if tls is None or not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.ca_file:
        context.load_verify_locations(tls.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
