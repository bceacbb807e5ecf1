"""The KV store role: KV-cache blocks under their chained-hash keys, in memory or Redis.

A gRPC server around a backend: in this process (LRU bounded by bytes, the
default) or a Redis server (Redis evicts by its own policy). A backend that cannot be reached (Redis down) makes calls fail with
UNAVAILABLE and the health status NOT_SERVING until it is back; the server
itself keeps running and recovers on its own. Examples:

    python -m tandem.services.kvstore.server --port 50081 --capacity 2GiB
    python -m tandem.services.kvstore.server --backend redis://127.0.0.1:6379/0
"""
from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import grpc
from grpc_health.v1 import health_pb2

from tandem.services.common.config import add_flag, config_error
from tandem.services.common.grpc_server import (RunningServer, add_tls_arguments, exit_after_shutdown,
                                                start_grpc_server, tls_from_args)
from tandem.services.kvstore.backends import Backend, BackendStats, BackendUnavailable, open_backend
from tandem.services.kvstore.client import split_chunks
from tandem.services.kvstore.value_slabs import sweep_dead_slabs
from tandem.v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

ROLE = "kvstore"
SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
# A Put stream hands values to the backend in batches of about this many
# bytes: bounds the server's memory per stream, and amortizes Redis round trips.
PUT_FLUSH_BYTES = 16 * 1024 * 1024
# Keys per backend.get inside one Get stream: bounds the values held at once.
GET_BATCH_KEYS = 16


# --- sizes on the command line --------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648. Binary units (KiB, Mi, GiB...) are powers of 1024,
    decimal ones (KB, M, GB...) powers of 1000, as in Kubernetes quantities."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r}; write a number of bytes with an optional unit, e.g. 512MiB, 2GiB, 1GB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


# --- metrics ---------------------------------------------------------------------------

class StoreMetrics:
    """The kvstore metrics (role="kvstore"): per-call counters from the servicer,
    gauges and evictions from polling the backend's stats."""

    def __init__(self) -> None:
        from tandem.services.common import metrics

        self._m = metrics
        self._last_evictions: Optional[int] = None
        self._last_fresh = 0
        self.copy_clock = None  # the data channel's CopyClock, once it runs
        self._last_copies = (0.0, 0.0, 0)
        # Shown as 0 until an engine on this host uses shared memory, or a value finds no slot.
        for name in ("KVSTORE_SHARED_BYTES", "KVSTORE_FRESH_BUFFERS", "KVSTORE_COPY_PAGE_FAULTS"):
            self._labelled(name)
        for clock in ("wall", "thread_cpu"):
            self._m.KVSTORE_COPY_SECONDS.labels(role=ROLE, clock=clock)

    def _labelled(self, name: str):
        return getattr(self._m, name).labels(role=ROLE)

    def on_put(self, stored: int, nbytes: int) -> None:
        self._labelled("KVSTORE_PUTS").inc(stored)
        self._labelled("KVSTORE_BYTES_IN").inc(nbytes)

    def on_get(self, hits: int, misses: int, nbytes: int) -> None:
        self._labelled("KVSTORE_HITS").inc(hits)
        self._labelled("KVSTORE_MISSES").inc(misses)
        self._labelled("KVSTORE_BYTES_OUT").inc(nbytes)

    def on_shared(self, nbytes: int) -> None:
        self._labelled("KVSTORE_SHARED_BYTES").inc(nbytes)

    def on_stats(self, stats: BackendStats) -> None:
        self._labelled("KVSTORE_BYTES").set(stats.bytes)
        self._labelled("KVSTORE_BLOCKS").set(stats.blocks)
        # Backend evictions are cumulative; a smaller value means the backend
        # restarted (Redis) and counts from zero again.
        last = self._last_evictions
        delta = stats.evictions if last is None or stats.evictions < last else stats.evictions - last
        self._last_evictions = stats.evictions
        if delta > 0:
            self._labelled("KVSTORE_EVICTIONS").inc(delta)
        if stats.fresh_buffers > self._last_fresh:
            self._labelled("KVSTORE_FRESH_BUFFERS").inc(stats.fresh_buffers - self._last_fresh)
        self._last_fresh = stats.fresh_buffers
        if self.copy_clock is not None:
            clock = self.copy_clock
            now = (clock.wall_seconds, clock.cpu_seconds, clock.page_faults)
            last, self._last_copies = self._last_copies, now
            self._m.KVSTORE_COPY_SECONDS.labels(role=ROLE, clock="wall").inc(now[0] - last[0])
            self._m.KVSTORE_COPY_SECONDS.labels(role=ROLE, clock="thread_cpu").inc(now[1] - last[1])
            self._labelled("KVSTORE_COPY_PAGE_FAULTS").inc(now[2] - last[2])


# --- the service -----------------------------------------------------------------------

@contextmanager
def _backend_errors(context: grpc.ServicerContext, what: str) -> Iterator[None]:
    try:
        yield
    except BackendUnavailable as exc:
        log.warning("%s failed: %s", what, exc)
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, backend: Backend, metrics: Optional[StoreMetrics] = None, data_port: int = 0) -> None:
        self.backend = backend
        self.metrics = metrics
        self.data_port = data_port

    def Put(self, request_iterator, context: grpc.ServicerContext) -> kvstore_pb2.PutResponse:
        reply = kvstore_pb2.PutResponse()
        batch: list[tuple[str, bytes]] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            with _backend_errors(context, "put"):
                stored = self.backend.put(batch)
            nbytes = sum(len(v) for (_, v), ok in zip(batch, stored) if ok)
            reply.stored += sum(stored)
            reply.refused += len(stored) - sum(stored)
            reply.bytes += nbytes
            if self.metrics:
                self.metrics.on_put(sum(stored), nbytes)
            batch, batch_bytes = [], 0

        key: Optional[str] = None  # set while a value's chunks are arriving
        parts: list[bytes] = []
        for request in request_iterator:
            if not request.key:
                flush()
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "PutRequest.key is empty: every chunk must carry its value's key")
            if key is not None and request.key != key:
                flush()
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk of key {request.key!r} arrived before the last chunk of key "
                              f"{key!r}: send a value's chunks consecutively, more=false on the last")
            key = request.key
            parts.append(request.data)
            if request.more:
                continue
            value = b"".join(parts)
            batch.append((key, value))
            batch_bytes += len(value)
            key, parts = None, []
            if batch_bytes >= PUT_FLUSH_BYTES:
                flush()
        flush()
        if key is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the stream ended inside the value of key {key!r} (its last chunk had "
                          f"more=true); the values before it were stored")
        return reply

    def Get(self, request: kvstore_pb2.GetRequest, context: grpc.ServicerContext):
        keys = list(request.keys)
        for start in range(0, len(keys), GET_BATCH_KEYS):
            batch = keys[start:start + GET_BATCH_KEYS]
            with _backend_errors(context, "get"):
                values = self.backend.get(batch)
            if self.metrics:
                hits = sum(v is not None for v in values)
                self.metrics.on_get(hits, len(values) - hits, sum(len(v) for v in values if v is not None))
            for key, value in zip(batch, values):
                if value is None:
                    yield kvstore_pb2.GetResponse(key=key, found=False)
                    continue
                for chunk, more in split_chunks(value):
                    yield kvstore_pb2.GetResponse(key=key, found=True, data=chunk, more=more)

    def Exists(self, request: kvstore_pb2.ExistsRequest, context: grpc.ServicerContext):
        with _backend_errors(context, "exists"):
            present = self.backend.exists(list(request.keys))
        return kvstore_pb2.ExistsResponse(present=present)

    def Delete(self, request: kvstore_pb2.DeleteRequest, context: grpc.ServicerContext):
        with _backend_errors(context, "delete"):
            deleted = self.backend.delete(list(request.keys))
        return kvstore_pb2.DeleteResponse(deleted=deleted)

    def Stats(self, request: kvstore_pb2.StatsRequest, context: grpc.ServicerContext):
        with _backend_errors(context, "stats"):
            s = self.backend.stats()
        return kvstore_pb2.StatsResponse(bytes=s.bytes, blocks=s.blocks, capacity_bytes=s.capacity_bytes,
                                         hits=s.hits, misses=s.misses, evictions=s.evictions,
                                         backend=s.backend, data_port=self.data_port)


def watch_backend(backend: Backend, server: RunningServer, metrics: Optional[StoreMetrics],
                  stop: threading.Event, interval_s: float = 1.0) -> None:
    """Until `stop`: export the backend's stats, and keep the health status in
    step with whether the backend answers (NOT_SERVING while Redis is down)."""
    def set_serving(serving: bool) -> None:
        server.set_serving(serving)  # the server as a whole ("")
        server.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if serving
                          else health_pb2.HealthCheckResponse.NOT_SERVING)

    healthy = True
    while not stop.is_set():
        try:
            stats = backend.stats()
        except BackendUnavailable as exc:
            if healthy:
                log.warning("backend unavailable, health NOT_SERVING until it is back: %s", exc)
                set_serving(False)
                healthy = False
        except Exception:  # the watcher must never take the service down
            log.exception("reading backend stats failed")
        else:
            if not healthy:
                log.info("backend reachable again, health SERVING")
                set_serving(True)
                healthy = True
            if metrics:
                metrics.on_stats(stats)
        stop.wait(interval_s)


# --- the command -----------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="127.0.0.1",
             help="address to listen on; 0.0.0.0 for every interface (in a container)")
    add_flag(parser, "--port", type=int, default=50081,
             help="gRPC port (control: Exists, Delete, Stats, health; and the older Put/Get); 0 picks a "
                  "free one (printed in the listening line)")
    add_flag(parser, "--data-port", type=int, default=50082,
             help="TCP port of the bulk data channel engines move blocks through (framed bytes outside "
                  "gRPC; Stats tells clients which port); 0 picks a free one, -1 turns it off")
    add_flag(parser, "--backend", default="memory",
             help="where blocks live: 'memory' (in this process, LRU bounded by --capacity-bytes) or "
                  "a Redis URL such as redis://127.0.0.1:6379/0 (Redis evicts by its own maxmemory "
                  "policy; give the store a database of its own)")
    add_flag(parser, "--capacity-bytes", type=parse_size, default="2GiB",
             help="memory backend: the most value bytes held before least recently used blocks are "
                  "evicted; accepts units, e.g. 512MiB, 2GiB, 1GB")
    parser.add_argument("--capacity", dest="capacity_bytes", type=parse_size, default=argparse.SUPPRESS,
                        help="same as --capacity-bytes")
    add_flag(parser, "--no-shared-slabs", type=bool, default=False,
             help="memory backend: keep values in private memory instead of /dev/shm segments. By "
                  "default engines on this host (same /dev/shm) map the store's slabs and copy blocks "
                  "between their GPU and the store's slots directly, one DMA each way; without room in "
                  "/dev/shm the store falls back to private memory by itself")
    add_flag(parser, "--preallocate", type=bool, default=False,
             help="memory backend: allocate all of --capacity-bytes at start, in the background, as vLLM "
                  "and LMCache allocate their CPU caches: no put then waits for new memory, and engines "
                  "on this host map every slab before a block needs it. Without it the store grows as "
                  "values arrive (a few GiB kept ready ahead), and the first minutes of a busy store "
                  "pay for that growth")
    add_flag(parser, "--metrics-port", type=int, default=0,
             help="HTTP port of this service's Prometheus /metrics; 0 turns it off")
    add_flag(parser, "--shutdown-timeout", type=float, default=5.0,
             help="on SIGTERM: seconds in-flight calls get to finish")
    add_tls_arguments(parser)


def _open_backend_or_exit(args: argparse.Namespace) -> Backend:
    try:
        return open_backend(args.backend, args.capacity_bytes, shared_slabs=not args.no_shared_slabs,
                            preallocate=args.preallocate)
    except ValueError as exc:
        raise SystemExit(f"error: --backend: {exc}")


# The store's threads (one per data connection, gRPC's, the buffer reserve's)
# each take the GIL back after every system call; at Python's 5 ms switch
# interval one that finds it held waits up to that long, a copy's worth of time
# many times over.
STORE_SWITCH_INTERVAL_S = 0.001


def serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then stop gracefully (in-flight calls get --shutdown-timeout)."""
    sys.setswitchinterval(STORE_SWITCH_INTERVAL_S)
    swept = sweep_dead_slabs()
    if swept:
        log.info("removed %d shared slabs of KV stores that no longer run from /dev/shm", swept)
    backend = _open_backend_or_exit(args)
    try:
        backend.stats()
    except BackendUnavailable as exc:
        # Not fatal: in a cluster Redis may come up after the store. Callers get
        # UNAVAILABLE (and fall back to recompute) until it answers.
        log.warning("starting anyway: %s", exc)

    metrics: Optional[StoreMetrics] = None
    if args.metrics_port > 0:
        from tandem.services.common.metrics import start_metrics_server

        metrics = StoreMetrics()
        start_metrics_server(args.metrics_port, host=args.host)
        print(f"{ROLE} metrics on http://{args.host}:{args.metrics_port}/metrics", flush=True)

    data = None
    if args.data_port >= 0:
        from tandem.services.kvstore.data_server import DataServer, server_ssl_context

        try:
            data = DataServer(backend, args.host, args.data_port, metrics,
                              server_ssl_context(tls_from_args(args))).start()
            if metrics is not None:
                metrics.copy_clock = data.copy_clock
        except OSError as exc:
            config_error(f"--data-port: cannot listen on {args.host}:{args.data_port}: {exc.strerror or exc}")

    def add_servicers(server: grpc.Server) -> list[str]:
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(
            KVStoreServicer(backend, metrics, data.port if data else 0), server)
        return [SERVICE_NAME]

    server = start_grpc_server(add_servicers, args.host, args.port, tls=tls_from_args(args))
    stop = threading.Event()
    watcher = threading.Thread(target=watch_backend, args=(backend, server, metrics, stop),
                               name="kvstore-watch", daemon=True)
    watcher.start()

    received: list[str] = []

    def on_signal(signum, _frame) -> None:
        # Only a note. Python runs this handler in the main thread between
        # bytecodes, possibly inside Event.wait holding the event's lock: a
        # stop.set() here then waited on that lock forever (CI, 2026-11-23
        # and 11-28: a store told to stop that never did).
        received.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if data is not None:
        print(f"{ROLE} data channel on {args.host}:{data.port}", flush=True)
    # The launcher and tests wait for exactly this line.
    print(f"{ROLE} listening on {args.host}:{server.port}", flush=True)
    while not received:
        time.sleep(0.2)  # short sleeps: the signal handler runs between them
    log.info("%s received, stopping", received[0])
    stop.set()
    server.stop(grace_s=args.shutdown_timeout)
    if data is not None:
        data.stop()
    watcher.join(timeout=5.0)
    backend.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description="tandem KV store: keeps KV-cache blocks under their chained-hash keys so prefill "
                    "instances can hand them to decode instances, and any instance can reuse a "
                    "prefix computed elsewhere.")
    add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = serve(args)
    log.info("stopped")
    exit_after_shutdown(code)


if __name__ == "__main__":
    main()
