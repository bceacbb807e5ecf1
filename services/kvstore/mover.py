"""The engine's KV store with its bytes moved by a helper process.

A serving engine's Python thread is always busy, and a transfer thread in the
same process needs the GIL between its socket calls: measured with a thread
spinning beside it, a 256 MiB transfer fell to a fraction of its idle speed
(docs/benchmarks.md). Here the arena is shared memory, and a child process
(the mover) maps it and runs a BlockStoreClient over it: it moves every byte
with a GIL of its own. The engine's side only sends each call's keys and
offsets down a pipe and waits for the answer, without the GIL.

When the KV store can map that same arena (on the same host: see
shared_arena.py), the mover only sends offsets, and the store copies the
values in and out of the arena.

Shared memory needs room in /dev/shm (containers give 64 MiB unless told
otherwise; the Helm chart mounts more): without it the client says so once
and moves bytes in this process instead, as BlockStoreClient does.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from tandem.services.common.grpc_server import TLSConfig
from tandem.services.common.parent_death import die_with_parent
from tandem.services.kvstore.block_client import LOOKUP_CONNECTIONS, BlockStoreClient
from tandem.services.kvstore.client import KVStoreUnavailable
from tandem.services.kvstore.frame_pipe import FramePipe
from tandem.services.kvstore.shared_arena import AttachedArena, SharedArena

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
# The switch interval engine processes that use a mover run with (Python's
# default is 5 ms): each call's answer wakes a thread that must then take the
# GIL from the engine's thread, and waits up to this long for it. At 5 ms a
# load's few wake-ups cost more than the load's bytes take to move (a 256 MiB
# load lasts 31-57 ms). At 1 ms the mover's paths (shared memory, the data
# channel) kept 0.74-0.91 of their idle speed beside a thread that never
# sleeps, at 0.25 ms 0.93-1.01 (a lent H100's host, docs/benchmarks.md). The
# price: a thread that computes beside another that never sleeps loses more to
# the finer turns (2-35% longer on the dev machine); beside one that wakes each
# millisecond for 50 us, as the engine's other threads do, no difference
# (python -m tandem.bench.switch_interval).
ENGINE_SWITCH_INTERVAL_S = 0.00025
# A get of more blocks than this goes to the mover as pieces of this many,
# which its workers move on connections (and the store on cores) of their
# own: one connection moves a request's 272 MiB with one store thread's memmove.
GET_PIECE_BLOCKS = 32


class MovedBlockStoreClient:
    """engine.connector.base.KVStore over a mover process (see the module's doc)."""

    def __init__(self, target: str, timeout_s: float = 5.0, tls: Optional[TLSConfig] = None,
                 connections: int = 4, store_shared_memory: bool = True) -> None:
        """store_shared_memory=False keeps values on the socket even where the
        store could map the arena (to measure the socket path)."""
        self.target = target
        self.timeout_s = timeout_s
        self._settings = (target, timeout_s, tls, connections)
        self._store_shared_memory = store_shared_memory
        self._segment: Optional[SharedArena] = None
        self._local: Optional[BlockStoreClient] = None  # without room in /dev/shm
        self._process: Optional[subprocess.Popen] = None
        self._pipe: Optional[FramePipe] = None
        self._calls: dict[int, _Call] = {}  # unanswered calls, under _replies
        self._replies = threading.Condition()
        self._reading = False  # a caller is reading replies (see _wait)
        self._ids = itertools.count()
        self.arena: Optional[memoryview] = None

    # ---- KVStore -----------------------------------------------------------
    def open_arena(self, nbytes: int) -> memoryview:
        try:
            self._segment = SharedArena(nbytes)
        except (OSError, ValueError) as exc:
            log.warning("no shared memory for a %.0f MiB KV staging arena (%s): KV bytes move in the "
                        "engine process instead, slower while it computes; give /dev/shm more room",
                        nbytes / 2**20, exc)
            self._local = BlockStoreClient(*self._settings)
            self.arena = self._local.open_arena(nbytes)
            return self.arena
        self.arena = self._segment.view
        self._start()
        return self.arena

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call("exists", list(keys))

    def put(self, items: Sequence[tuple[str, int, int]]) -> int:
        return self._call("put", list(items))

    def get(self, items: Sequence[tuple[str, int, int]]) -> list[bool]:
        items = list(items)
        if self._local is not None or len(items) <= GET_PIECE_BLOCKS:
            return self._call("get", items)
        pieces = [items[i:i + GET_PIECE_BLOCKS] for i in range(0, len(items), GET_PIECE_BLOCKS)]
        return [found for piece in self._call_many("get", pieces) for found in piece]

    def lent_slots(self, pin_memory=None, unpin_memory=None, observe=None):
        """The store's own slots, where it lends them (engine.connector.base.StoreSlots):
        used in this process, since only small requests cross the socket."""
        from tandem.services.kvstore.lent_slots import LentSlots

        target, timeout_s, tls, _connections = self._settings
        return LentSlots(target, timeout_s, tls, pin_memory=pin_memory, unpin_memory=unpin_memory,
                          observe=observe)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        if self._pipe is not None:
            try:
                self._pipe.send(None)
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

    # ---- the mover ---------------------------------------------------------
    def _start(self) -> None:
        # Its own interpreter, not a multiprocessing child: that would import the
        # engine's __main__ (torch and the model code) again, 10x the memory.
        ours, theirs = socket.socketpair()
        target, timeout_s, tls, connections = self._settings
        argv = [sys.executable, "-m", "tandem.services.kvstore.mover", "--fd", str(theirs.fileno()),
                "--segment", self._segment.name, "--token", self._segment.token.hex(),
                "--size", str(self._segment.size), "--target", target, "--timeout", str(timeout_s),
                "--connections", str(connections)]
        if not self._store_shared_memory:
            argv.append("--no-store-shared-memory")
        if tls is not None:
            for flag, path in (("--tls-cert", tls.cert_file), ("--tls-key", tls.key_file), ("--tls-ca", tls.ca_file)):
                if path:
                    argv += [flag, path]
        self._process = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._pipe = FramePipe(ours)
        try:
            ready = self._pipe.receive(START_TIMEOUT_S)
        except EOFError:
            ready = []
        if ready != ["ready"]:
            self._process.kill()
            raise RuntimeError("the KV mover process did not start")

    def _call(self, op: str, args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, op)(args)
        return self._call_many(op, [args])[0]

    def _call_many(self, op: str, each: list) -> list:
        """`op` once per entry of `each`, all sent before any answer is awaited
        (the mover runs them side by side); their values in order. Raises
        KVStoreUnavailable if any fails."""
        if self._process is None or self._process.poll() is not None:
            raise KVStoreUnavailable(f"KV store at {self.target}: the KV mover process has stopped")
        calls = [(next(self._ids), _Call()) for _ in each]
        with self._replies:
            self._calls.update(calls)
        try:
            self._pipe.send(*[(call_id, op, args) for (call_id, _), args in zip(calls, each)])
        except OSError as exc:
            self._forget(calls)
            raise KVStoreUnavailable(f"KV store at {self.target}: the KV mover is gone: {exc}") from exc
        # The mover gives up on the store after timeout_s; this waits a little longer for its answers.
        deadline = time.monotonic() + self.timeout_s * 2 + 5
        for _, call in calls:
            if not self._wait(call, deadline):
                self._forget(calls)
                raise KVStoreUnavailable(f"KV store at {self.target}: the KV mover did not answer {op}")
        failed = next((call for _, call in calls if not call.ok), None)
        if failed is not None:
            raise KVStoreUnavailable(failed.value)
        return [call.value for _, call in calls]

    def _forget(self, calls: list[tuple[int, "_Call"]]) -> None:
        """Stop waiting for these calls (answers that come later are dropped)."""
        with self._replies:
            for call_id, _ in calls:
                self._calls.pop(call_id, None)

    def _wait(self, call: "_Call", deadline: float) -> bool:
        """Until `call` is answered (False: the deadline passed first).

        The replies are read by whichever waiting caller finds nobody reading,
        not by a thread of their own: beside a busy engine thread each wake-up
        waits for the GIL (up to the switch interval), and a caller that
        reads its own reply wakes once, where a reader thread and then the
        caller would wake twice."""
        with self._replies:
            while not call.done:
                if not self._reading:
                    self._reading = True
                    break
                if not self._replies.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    return False
            else:
                return True
        try:
            while not call.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    replies = self._pipe.receive(remaining)
                except (EOFError, OSError):
                    self._fail_all(f"KV store at {self.target}: the KV mover process stopped")
                    return True
                with self._replies:
                    for call_id, ok, value in replies:
                        answered = self._calls.pop(call_id, None)
                        if answered is not None:
                            answered.done, answered.ok, answered.value = True, ok, value
                            if answered is not call:
                                self._replies.notify_all()
            return True
        finally:
            with self._replies:
                self._reading = False
                self._replies.notify_all()  # another caller reads from here on

    def _fail_all(self, message: str) -> None:
        with self._replies:
            for waiting in self._calls.values():
                waiting.done, waiting.ok, waiting.value = True, False, message
            self._calls.clear()
            self._replies.notify_all()


class _Call:
    """One call's answer: (ok, value) once done."""

    __slots__ = ("done", "ok", "value")

    def __init__(self) -> None:
        self.done, self.ok, self.value = False, False, None


def _mover_main(settings: tuple, segment: AttachedArena, pipe: FramePipe, store_shared: bool) -> None:
    """The mover process: calls from the pipe, run a few at a time, answered in any order."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the group; the engine stops us
    client = BlockStoreClient(*settings)
    client.arena = segment.view
    if store_shared:
        client.shared = (segment.name, segment.token)

    def run(call_id: int, op: str, args: Any) -> None:
        try:
            reply = (call_id, True, getattr(client, op)(args))
        except KVStoreUnavailable as exc:
            reply = (call_id, False, str(exc))
        except Exception as exc:  # any other failure: the engine recomputes
            reply = (call_id, False, f"KV store at {client.target}: {op} failed in the mover: {exc!r}")
        try:
            pipe.send(reply)
        except OSError:
            pass  # the engine is gone; the loop below sees it too

    # A worker per connection. Lookups have workers (and connections) of their
    # own: queued behind a load's pieces, a decode's lookup waited 23 ms (H200).
    movers = ThreadPoolExecutor(max_workers=settings[3], thread_name_prefix="kv-mover")
    lookups = ThreadPoolExecutor(max_workers=LOOKUP_CONNECTIONS, thread_name_prefix="kv-lookup")
    pipe.send("ready")
    try:
        stopping = False
        while not stopping:
            for message in pipe.receive():
                if message is None:
                    stopping = True
                    break
                (lookups if message[1] == "exists" else movers).submit(run, *message)
    except (EOFError, OSError):
        pass
    movers.shutdown(wait=True)
    lookups.shutdown(wait=True)
    client.close()
    client.arena = None
    segment.close()


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m tandem.services.kvstore.mover`: started by MovedBlockStoreClient, not by hand."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the socket to the engine")
    parser.add_argument("--segment", required=True, help="the shared-memory arena")
    parser.add_argument("--token", required=True, help="the token after the arena, in hex")
    parser.add_argument("--size", type=int, required=True, help="the arena's bytes")
    parser.add_argument("--no-store-shared-memory", action="store_true",
                        help="never offer the arena to the store: values go over the socket")
    parser.add_argument("--target", required=True, help="the KV store's gRPC address")
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-ca")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca) if (args.tls_cert or args.tls_ca) else None
    segment = AttachedArena(args.segment, bytes.fromhex(args.token), args.size)
    pipe = FramePipe(socket.socket(fileno=args.fd))
    _mover_main((args.target, args.timeout, tls, args.connections), segment, pipe, not args.no_store_shared_memory)


if __name__ == "__main__":
    main()
