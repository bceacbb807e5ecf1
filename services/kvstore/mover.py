"""The engine's KV store with its bytes moved by a helper process.

A serving engine's Python thread is always busy, and a transfer thread in the
same process needs the GIL between its socket calls: measured with a thread
spinning beside it, a 256 MiB transfer fell to a fraction of its idle speed
(docs/benchmarks.md). Here the arena is shared memory, and a child process
(the mover) maps it and runs a BlockStoreClient over it: it moves every byte
with a GIL of its own. The engine's side only sends each call's keys and
offsets down a pipe and waits for the answer, without the GIL.

Shared memory needs room in /dev/shm (containers give 64 MiB unless told
otherwise; the Helm chart mounts more): without it the client says so once
and moves bytes in this process instead, as BlockStoreClient does.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Optional, Sequence

from tandem.services.common.grpc_server import TLSConfig
from tandem.services.kvstore.block_client import BlockStoreClient
from tandem.services.kvstore.client import KVStoreUnavailable

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "tandem-kvarena-"
START_TIMEOUT_S = 60.0


class MovedBlockStoreClient:
    """engine.connector.base.KVStore over a mover process (see the module's doc)."""

    def __init__(self, target: str, timeout_s: float = 5.0, tls: Optional[TLSConfig] = None,
                 connections: int = 4) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._settings = (target, timeout_s, tls, connections)
        self._segment: Optional[SharedMemory] = None
        self._local: Optional[BlockStoreClient] = None  # without room in /dev/shm
        self._process: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._reader: Optional[threading.Thread] = None
        self.arena: Optional[memoryview] = None

    # ---- KVStore -----------------------------------------------------------
    def open_arena(self, nbytes: int) -> memoryview:
        try:
            self._segment = SharedMemory(name=f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}",
                                         create=True, size=nbytes)
            _check_room(nbytes)
        except (OSError, ValueError) as exc:
            if self._segment is not None:
                self._segment.close()
                self._segment.unlink()
                self._segment = None
            log.warning("no shared memory for a %.0f MiB KV staging arena (%s): KV bytes move in the "
                        "engine process instead, slower while it computes; give /dev/shm more room",
                        nbytes / 2**20, exc)
            self._local = BlockStoreClient(*self._settings)
            self.arena = self._local.open_arena(nbytes)
            return self.arena
        self.arena = self._segment.buf
        self._start()
        return self.arena

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call("exists", list(keys))

    def put(self, items: Sequence[tuple[str, int, int]]) -> int:
        return self._call("put", list(items))

    def get(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        return self._call("get", list(items))

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        if self._conn is not None:
            with self._send_lock:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._segment is not None:
            self.arena = None
            self._segment.close()
            self._segment.unlink()

    # ---- the mover ---------------------------------------------------------
    def _start(self) -> None:
        # Its own interpreter, not a multiprocessing child: that would import the
        # engine's __main__ (torch and the model code) again, 10x the memory.
        ours, theirs = socket.socketpair()
        target, timeout_s, tls, connections = self._settings
        argv = [sys.executable, "-m", "tandem.services.kvstore.mover", "--fd", str(theirs.fileno()),
                "--segment", self._segment.name, "--target", target, "--timeout", str(timeout_s),
                "--connections", str(connections)]
        if tls is not None:
            for flag, path in (("--tls-cert", tls.cert_file), ("--tls-key", tls.key_file), ("--tls-ca", tls.ca_file)):
                if path:
                    argv += [flag, path]
        self._process = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        if not self._conn.poll(START_TIMEOUT_S) or self._conn.recv() != "ready":
            self._process.kill()
            raise RuntimeError("the KV mover process did not start")
        self._reader = threading.Thread(target=self._read_replies, name="kv-mover-replies", daemon=True)
        self._reader.start()

    def _call(self, op: str, args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, op)(args)
        if self._process is None or self._process.poll() is not None:
            raise KVStoreUnavailable(f"KV store at {self.target}: the KV mover process has stopped")
        call_id = next(self._ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            with self._send_lock:
                self._conn.send((call_id, op, args))
        except OSError as exc:
            self._calls.pop(call_id, None)
            raise KVStoreUnavailable(f"KV store at {self.target}: the KV mover is gone: {exc}") from exc
        # The mover gives up on the store after timeout_s; this waits a little longer for its answer.
        try:
            ok, value = future.result(timeout=self.timeout_s * 2 + 5)
        except FutureTimeout:
            self._calls.pop(call_id, None)
            raise KVStoreUnavailable(f"KV store at {self.target}: the KV mover did not answer {op}") from None
        if not ok:
            raise KVStoreUnavailable(value)
        return value

    def _read_replies(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            future = self._calls.pop(call_id, None)
            if future is not None:
                future.set_result((ok, value))
        for future in list(self._calls.values()):  # the mover died: every waiting call fails now
            future.set_result((False, f"KV store at {self.target}: the KV mover process stopped"))
        self._calls.clear()


def _check_room(nbytes: int) -> None:
    # Pages of a segment are only taken when written: a segment larger than
    # /dev/shm fails later with SIGBUS, in the middle of a transfer.
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ValueError(f"/dev/shm has {free / 2**20:.0f} MiB free")


def _mover_main(settings: tuple, segment_name: str, conn: Connection) -> None:
    """The mover process: calls from the pipe, run a few at a time, answered in any order."""
    from multiprocessing import resource_tracker

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the group; the engine stops us
    segment = SharedMemory(name=segment_name)
    resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 (the engine unlinks it)
    client = BlockStoreClient(*settings)
    client.arena = segment.buf
    send_lock = threading.Lock()

    def run(call_id: int, op: str, args: Any) -> None:
        try:
            reply = (call_id, True, getattr(client, op)(args))
        except KVStoreUnavailable as exc:
            reply = (call_id, False, str(exc))
        except Exception as exc:  # any other failure: the engine recomputes
            reply = (call_id, False, f"KV store at {client.target}: {op} failed in the mover: {exc!r}")
        with send_lock:
            conn.send(reply)

    workers = ThreadPoolExecutor(max_workers=settings[3], thread_name_prefix="kv-mover")
    conn.send("ready")
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            workers.submit(run, *message)
    except (EOFError, OSError):
        pass
    workers.shutdown(wait=True)
    client.close()
    client.arena = None
    segment.close()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m tandem.services.kvstore.mover`: started by MovedBlockStoreClient, not by hand."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the socket to the engine")
    parser.add_argument("--segment", required=True, help="the shared-memory arena")
    parser.add_argument("--target", required=True, help="the KV store's gRPC address")
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-ca")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca) if (args.tls_cert or args.tls_ca) else None
    _mover_main((args.target, args.timeout, tls, args.connections), args.segment, Connection(args.fd))


if __name__ == "__main__":
    main()
