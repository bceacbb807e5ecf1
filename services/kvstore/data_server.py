"""The KV store's bulk data channel, server side (data_wire.py has the format).

One thread per connection: it reads a request, moves the values between the
socket and the backend, answers, and reads the next. Values are received
into buffers of their own size (one copy, out of the kernel) and kept as
they are by the memory backend; they are sent from the backend's own bytes.
Socket calls wait without the GIL, so connections proceed side by side.

A connection that attached its client's shared-memory arena (ATTACH) moves
values by copying them between the arena and those same buffers instead,
one memmove each without the GIL (shared_arena.AttachedArena). The
connections of one arena share one mapping of it.

A memory backend with shared slabs also lends its slots to engines on its
host (RESERVE/COMMIT to write a value in place, PIN/RELEASE to read one):
the store then moves no bytes at all. A connection's reservations and pins
are its own and end with it.
"""
from __future__ import annotations

import logging
import os
import resource
import socket
import socketserver
import ssl
import threading
import time
from typing import Optional

from tandem.services.kvstore import data_wire as wire
from tandem.services.kvstore.backends import Backend, BackendUnavailable
from tandem.services.kvstore.shared_arena import TOKEN_BYTES, AttachedArena

log = logging.getLogger(__name__)

# A PUT hands values to the backend in batches of about this many bytes.
PUT_FLUSH_BYTES = 16 * 1024 * 1024
# Keys per backend.get inside one GET: bounds the values held at once.
GET_BATCH_KEYS = 16
# Shared-memory puts and gets move values in batches of about this many bytes.
SHARED_BATCH_BYTES = 16 * 1024 * 1024
SOCKET_BUFFER_BYTES = 8 * 1024 * 1024
_END = object()  # the end of a backend's iter_get


def _put_delay_s() -> float:
    """Fault tests only (TANDEM_FAULT_HOOKS=1): every put waits this long
    (TANDEM_KVSTORE_PUT_DELAY_S) before storing, so a decode asks for blocks
    whose write has not landed."""
    if os.environ.get("TANDEM_FAULT_HOOKS") != "1":
        return 0.0
    delay = float(os.environ.get("TANDEM_KVSTORE_PUT_DELAY_S", "0") or 0)
    if delay > 0:
        log.warning("TANDEM_KVSTORE_PUT_DELAY_S=%g: every put is delayed (fault tests only)", delay)
    return delay


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def setup(self) -> None:
        # Receive buffers of this connection, for backends that do not keep
        # them (Redis has its own copy once put returns): size -> free buffers.
        self._spare: dict[int, list[bytearray]] = {}
        self._arena: Optional[AttachedArena] = None  # the client's, once it attached it
        # Slots lent over this connection: reserved (key -> slot, not yet a value)
        # and pinned (key -> the values' slots: a key may be pinned more than once).
        self._reserved: dict[str, memoryview] = {}
        self._pinned: dict[str, list[memoryview]] = {}
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
                    self._put(sock, keys, self._receiver(sock))
                elif op == wire.OP_GET:
                    self._get(sock, keys)
                elif op == wire.OP_EXISTS:
                    self._exists(sock, keys)
                elif op == wire.OP_ATTACH:
                    self._attach(sock, keys)
                elif op == wire.OP_PUT_SHARED:
                    self._put_shared(sock, keys, wire.read_spans(sock, len(keys)))
                elif op == wire.OP_GET_SHARED:
                    self._get_shared(sock, keys, wire.read_spans(sock, len(keys)))
                elif op == wire.OP_SLABS:
                    self._slabs(sock)
                elif op == wire.OP_RESERVE:
                    self._reserve(sock, keys, wire.read_lengths(sock, len(keys)))
                elif op == wire.OP_COMMIT:
                    self._commit(sock, keys)
                elif op == wire.OP_PIN:
                    self._pin(sock, keys, wire.read_lengths(sock, len(keys)))
                else:
                    self._release(keys)
                    sock.sendall(wire.OK)
            except (OSError, ssl.SSLError, wire.ProtocolError) as exc:
                log.info("data channel: connection from %s ended during %s: %s", self.client_address,
                         wire.OPS[op], exc)
                return

    def finish(self) -> None:
        if self._arena is not None:
            self.server.arenas.detach(self._arena)
            self._arena = None
        for slot in self._reserved.values():
            self.server.backend.unreserve(slot)
        self._reserved.clear()
        self._pinned.clear()

    # ---- the store's slots lent to the client (same host) -------------------------------
    def _lender(self, sock: socket.socket):
        """The backend, when it lends slots; otherwise says why not (None)."""
        backend = self.server.backend
        if not getattr(backend, "lends_slots", False):
            wire.send_failed(sock, "this KV store lends no slots (its values are not in shared memory: "
                                   "a Redis backend, or a memory store started with --no-shared-slabs)")
            return None
        return backend

    def _slabs(self, sock: socket.socket) -> None:
        backend = self._lender(sock)
        if backend is None:
            return
        # Asked first: a slab made after the list must not be missed.
        state = (wire.SLABS_COMPLETE if backend.slabs_complete
                 else wire.SLABS_ALLOCATING if backend.preallocate else wire.SLABS_GROWING)
        slabs = backend.shared_slabs()
        parts = [wire.OK, backend.slab_token, bytes([state]), wire.COUNT.pack(len(slabs))]
        for index, name, size in slabs:
            raw = name.encode()
            parts.append(wire.SLAB.pack(index, size, len(raw)) + raw)
        sock.sendall(b"".join(parts))

    def _reserve(self, sock: socket.socket, keys: list[str], lengths: list[int]) -> None:
        backend = self._lender(sock)
        if backend is None:
            return
        places = []
        for key, length in zip(keys, lengths):
            if key in self._reserved:  # reserved again: the earlier slot goes back
                backend.unreserve(self._reserved.pop(key))
            lent = backend.reserve_slot(length)
            if lent is None:
                places.append((-1, 0))
                continue
            self._reserved[key] = lent[0]
            places.append((lent[1].slab, lent[1].offset))
        sock.sendall(wire.OK + wire.encode_places(places))

    def _commit(self, sock: socket.socket, keys: list[str]) -> None:
        """The reserved slots of `keys` become their values (the client has filled them)."""
        if self.server.put_delay_s:
            time.sleep(self.server.put_delay_s)
        items = [(key, self._reserved.pop(key)) for key in keys if key in self._reserved]
        stored = 0
        if items:
            try:
                results = self.server.backend.put(items)
            except BackendUnavailable as exc:  # not for a memory backend; kept for the protocol's sake
                wire.send_failed(sock, str(exc))
                return
            stored = sum(results)
            for (_, slot), ok in zip(items, results):
                if not ok:
                    self.server.backend.unreserve(slot)
            metrics = self.server.metrics
            if metrics is not None:
                nbytes = sum(len(slot) for (_, slot), ok in zip(items, results) if ok)
                metrics.on_put(stored, nbytes)
                metrics.on_shared(nbytes)
        sock.sendall(wire.OK + wire.PUT_REPLY.pack(stored, len(keys) - stored))

    def _pin(self, sock: socket.socket, keys: list[str], lengths: list[int]) -> None:
        backend = self._lender(sock)
        if backend is None:
            return
        places, nbytes = [], 0
        for key, length, lent in zip(keys, lengths, backend.pin(keys, lengths)):
            if lent is None:
                places.append((-1, 0))
                continue
            self._pinned.setdefault(key, []).append(lent[0])
            places.append((lent[1].slab, lent[1].offset))
            nbytes += length
        hits = sum(1 for slab, _ in places if slab >= 0)
        if self.server.metrics is not None:
            self.server.metrics.on_get(hits, len(keys) - hits, nbytes)
            self.server.metrics.on_shared(nbytes)
        sock.sendall(wire.OK + wire.encode_places(places))

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            slot = self._reserved.pop(key, None)
            if slot is not None:
                self.server.backend.unreserve(slot)
            pinned = self._pinned.get(key)
            if pinned:
                pinned.pop()  # the value's slot may be reused once no other pin or value holds it
                if not pinned:
                    del self._pinned[key]

    # ---- values in the client's shared memory ----------------------------------------
    def _attach(self, sock: socket.socket, keys: list[str]) -> None:
        (size,) = wire.recv_struct(sock, wire.VALUE_LEN)
        token = bytes(wire.recv_exactly(sock, TOKEN_BYTES))
        if len(keys) != 1:
            raise wire.ProtocolError(f"ATTACH names one segment, not {len(keys)}")
        if self._arena is not None:
            self.server.arenas.detach(self._arena)
            self._arena = None
        try:
            self._arena = self.server.arenas.attach(keys[0], token, size)
        except ValueError as exc:  # another host or pod: the client uses the socket
            wire.send_failed(sock, str(exc))
            return
        sock.sendall(wire.OK)

    def _attached(self, spans: list[tuple[int, int]]) -> AttachedArena:
        """The connection's attached arena, once every span is checked against it."""
        if self._arena is None:
            raise wire.ProtocolError("a shared-memory request on a connection that attached no arena")
        try:
            self._arena.check(spans)
        except ValueError as exc:
            raise wire.ProtocolError(str(exc)) from None
        return self._arena

    def _put_shared(self, sock: socket.socket, keys: list[str], spans: list[tuple[int, int]]) -> None:
        """PUT_SHARED: the values are copied out of the client's arena in
        batches, each then stored at once."""
        arena = self._attached(spans)
        if self.server.put_delay_s:
            time.sleep(self.server.put_delay_s)
        backend, metrics = self.server.backend, self.server.metrics
        keeps = getattr(backend, "keeps_values", True)
        stored = refused = 0
        for first, last in _batches([length for _, length in spans], SHARED_BATCH_BYTES):
            values = [self._buffer(length, keeps) for _, length in spans[first:last]]
            with self.server.copy_clock:
                arena.read_into(values, spans[first:last])
            try:
                results = backend.put(list(zip(keys[first:last], values)))
            except BackendUnavailable as exc:
                wire.send_failed(sock, str(exc))
                return
            finally:
                if not keeps:
                    for value in values:
                        self._spare.setdefault(len(value), []).append(value)
            ok = sum(results)
            stored, refused = stored + ok, refused + len(results) - ok
            if metrics is not None:
                nbytes = sum(len(v) for v, r in zip(values, results) if r)
                metrics.on_put(ok, nbytes)
                metrics.on_shared(nbytes)
        sock.sendall(wire.OK + wire.PUT_REPLY.pack(stored, refused))

    def _get_shared(self, sock: socket.socket, keys: list[str], spans: list[tuple[int, int]]) -> None:
        """GET_SHARED: found values are copied into the client's arena, a batch at a time."""
        arena = self._attached(spans)
        backend, metrics = self.server.backend, self.server.metrics
        copied = bytearray(len(keys))
        hits = misses = nbytes = 0
        release = getattr(backend, "release_values", None)  # buffers the backend wants back once copied
        try:
            for first, last in _batches([length for _, length in spans], SHARED_BATCH_BYTES):
                values = backend.get(keys[first:last])
                found, where = [], []
                for i, value in enumerate(values, first):
                    if value is None:
                        misses += 1
                        continue
                    hits += 1
                    if len(value) == spans[i][1]:  # another length: another model's block
                        found.append(value)
                        where.append(spans[i])
                        copied[i] = 1
                        nbytes += len(value)
                with self.server.copy_clock:
                    arena.write_from(found, where)
                if release is not None:
                    release(values)
        except BackendUnavailable as exc:
            wire.send_failed(sock, str(exc))
            return
        if metrics is not None:
            metrics.on_get(hits, misses, nbytes)
            metrics.on_shared(nbytes)
        sock.sendall(wire.OK + bytes(copied))

    def _receiver(self, sock: socket.socket):
        """PUT's values: each a u64 length, then its bytes, read off the socket."""
        def value(_i: int):
            (length,) = wire.recv_struct(sock, wire.VALUE_LEN)
            return length, lambda buffer: wire.recv_exactly_into(sock, memoryview(buffer))
        return value

    def _put(self, sock: socket.socket, keys: list[str], values) -> None:
        """Store the request's values; values(i) is (length, fill): fill(buffer)
        writes value i into a buffer of that length (read off the socket)."""
        if self.server.put_delay_s:
            time.sleep(self.server.put_delay_s)
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
                        nbytes = sum(len(v) for (_, v), r in zip(batch, results) if r)
                        metrics.on_put(ok, nbytes)
            if not keeps:
                for _, value in batch:
                    self._spare.setdefault(len(value), []).append(value)
            batch, batch_bytes = [], 0

        for i, key in enumerate(keys):
            length, fill = values(i)
            # Read even after a failure: the stream stays in step.
            value = self._buffer(length, keeps)
            fill(value)
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


class _Arenas:
    """The engines' arenas this store has mapped: one mapping per segment,
    however many of its client's connections attached it (a mapping of each
    connection's own would take every page's fault again), kept while any of
    them is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, bytes, int], list] = {}  # (name, token, size) -> [arena, connections]

    def attach(self, name: str, token: bytes, size: int) -> AttachedArena:
        key = (name, token, size)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                entry = self._open[key] = [AttachedArena(name, token, size), 0]
                threading.Thread(target=entry[0].populate_if_resident, name="kvstore-populate",
                                 daemon=True).start()
            entry[1] += 1
            return entry[0]

    def detach(self, arena: AttachedArena) -> None:
        key = (arena.name, arena.token, arena.size)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[key]
                arena.close()


class CopyClock:
    """Seconds the store spent copying values between engines' arenas and its
    own memory: wall time and the copying threads' CPU time (a thread waiting
    for the GIL, or for memory, shows wall time without CPU time), and the
    page faults they took. A context manager around each batch's copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.wall_seconds = self.cpu_seconds = 0.0
        self.page_faults = 0
        self._local = threading.local()

    def __enter__(self) -> None:
        self._local.start = (time.perf_counter(), time.thread_time(), _thread_faults())

    def __exit__(self, *exc) -> None:
        wall, cpu, faults = self._local.start
        wall, cpu, faults = time.perf_counter() - wall, time.thread_time() - cpu, _thread_faults() - faults
        with self._lock:
            self.wall_seconds += wall
            self.cpu_seconds += cpu
            self.page_faults += faults


def _thread_faults() -> int:
    """Page faults this thread has taken (minor and major)."""
    usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return usage.ru_minflt + usage.ru_majflt


def _batches(lengths: list[int], max_bytes: int) -> list[tuple[int, int]]:
    """[first, last) index ranges of consecutive lengths, each summing to at most
    max_bytes (or a single length larger than that)."""
    out, first, total = [], 0, 0
    for i, length in enumerate(lengths):
        if i > first and total + length > max_bytes:
            out.append((first, i))
            first, total = i, 0
        total += length
    if first < len(lengths):
        out.append((first, len(lengths)))
    return out


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    # SO_REUSEADDR, as gRPC's own port has: a store restarted after a crash
    # binds again although its engines' connections to the old one linger in
    # TIME_WAIT. On Linux it never lets two stores listen on one port: a port
    # another process listens on is still an error at start.
    allow_reuse_address = True

    def __init__(self, address, backend: Backend, metrics, ssl_context) -> None:
        # metrics: on_put(stored, bytes) and on_get(hits, misses, bytes), as server.StoreMetrics has
        self.backend = backend
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.put_delay_s = _put_delay_s()
        self.arenas = _Arenas()
        self.copy_clock = CopyClock()
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

    @property
    def copy_clock(self) -> CopyClock:
        return self._server.copy_clock

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
