"""The KV store on the engine's host: a real store process maps the client's
shared-memory arena and copies values in and out of it, with no bytes on the
socket; a store that cannot map it (another /dev/shm) gets the values over the
socket; the store opens nothing but a tandem arena whose token matches, and
touches nothing outside it."""
from __future__ import annotations

import os
import socket
import urllib.request

import pytest

from tandem.services.kvstore import data_wire as wire
from tandem.services.kvstore.block_client import BlockStoreClient
from tandem.services.kvstore.client import KVStoreClient
from tandem.services.kvstore.mover import MovedBlockStoreClient
from tandem.services.kvstore.shared_arena import SharedArena
from tests.support.kvstore_process import start_store
from tests.support.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BLOCK = 300_000
SHARED = 'tandem:kvstore_shared_memory_bytes_total{role="kvstore"}'
BYTES_IN = 'tandem:kvstore_bytes_in_total{role="kvstore"}'


@pytest.fixture
def store():
    metrics_port = free_port()
    proc = start_store("--backend", "memory", "--capacity", "64MiB", "--metrics-port", str(metrics_port))
    proc.metrics_port = metrics_port
    yield proc
    proc.stop()


def series(store) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines
                                                   if line.startswith("tandem:kvstore_"))}


def items(keys: list[str], first_slot: int = 0) -> list[tuple[str, int, int]]:
    return [(key, (first_slot + i) * BLOCK, BLOCK) for i, key in enumerate(keys)]


def shared_client(target: str, blocks: int, token: bytes | None = None) -> tuple[BlockStoreClient, SharedArena]:
    """A client over a shared arena, offering it to the store (with a wrong
    token when given one: what a store with another /dev/shm would find)."""
    segment = SharedArena(blocks * BLOCK)
    segment.view[:] = os.urandom(blocks * BLOCK)
    client = BlockStoreClient(target, timeout_s=10.0)
    client.arena = segment.view
    client.shared = (segment.name, token or segment.token)
    return client, segment


def test_a_store_on_this_host_copies_values_through_the_engines_shared_memory(store):
    client, segment = shared_client(store.target, 5)
    try:
        a, b, _, missing = (bytes(segment.view[i * BLOCK:(i + 1) * BLOCK]) for i in range(4))
        assert client.put(items(["a", "b"])) == 2
        assert client.exists(["a", "b", "c"]) == [True, True, False]
        assert client.get(items(["b", "c", "a"], first_slot=2)) == [True, False, True]
        view = segment.view
        assert (bytes(view[2 * BLOCK:3 * BLOCK]), bytes(view[3 * BLOCK:4 * BLOCK]),
                bytes(view[4 * BLOCK:])) == (b, missing, a)  # a miss leaves its span as it was
        assert client._attached, "the store did not map the arena"
        got = series(store)
        assert got[SHARED] == 4 * BLOCK and got[BYTES_IN] == 2 * BLOCK  # two values in, two out
    finally:
        client.close()
        segment.close()


def test_values_put_through_the_socket_are_read_through_shared_memory_and_back(store):
    plain = BlockStoreClient(store.target, timeout_s=10.0)
    arena = plain.open_arena(2 * BLOCK)
    arena[:] = os.urandom(2 * BLOCK)
    shared, segment = shared_client(store.target, 2)
    try:
        assert plain.put(items(["p"])) == 1
        assert shared.get(items(["p"])) == [True] and bytes(segment.view[:BLOCK]) == bytes(arena[:BLOCK])
        assert shared.put(items(["s"], first_slot=1)) == 1
        assert plain.get(items(["s"], first_slot=1)) == [True]
        assert bytes(arena[BLOCK:]) == bytes(segment.view[BLOCK:])
    finally:
        plain.close()
        shared.close()
        segment.close()


def test_a_store_that_cannot_map_the_arena_gets_the_values_over_the_socket(store):
    client, segment = shared_client(store.target, 2, token=b"\x00" * 16)
    try:
        assert client.put(items(["x"])) == 1 and client.get(items(["x"], first_slot=1)) == [True]
        assert bytes(segment.view[BLOCK:]) == bytes(segment.view[:BLOCK])
        assert not client._attached
        assert series(store)[SHARED] == 0
    finally:
        client.close()
        segment.close()


def _request(sock: socket.socket, op: int, keys: list[str], tail: bytes = b"") -> None:
    sock.sendall(wire.request_header(op, keys) + tail)


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_store_maps_only_a_tandem_arena_and_only_inside_it(store):
    port = KVStoreClient(store.target).stats().data_port
    segment = SharedArena(2 * BLOCK)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for name in ("../../etc/passwd", "tandem-kvarena-nothing-here", "psm_other"):
                _request(sock, wire.OP_ATTACH, [name], wire.VALUE_LEN.pack(BLOCK) + segment.token)
                with pytest.raises(wire.RemoteError):
                    wire.read_status(sock)
            # a shared-memory request with no arena attached: dropped
            _request(sock, wire.OP_GET_SHARED, ["k"], wire.SPAN.pack(0, BLOCK))
            assert _closed(sock)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            _request(sock, wire.OP_ATTACH, [segment.name], wire.VALUE_LEN.pack(2 * BLOCK) + segment.token)
            wire.read_status(sock)
            before = bytes(segment.view)
            # a span past the arena's end: refused before any byte moves
            _request(sock, wire.OP_PUT_SHARED, ["k"], wire.SPAN.pack(BLOCK + 1, BLOCK))
            assert _closed(sock)
            assert bytes(segment.view) == before
        assert KVStoreClient(store.target).exists(["k"]) == [False]
    finally:
        segment.close()


@pytest.mark.parametrize("offered", [True, False], ids=["shared", "socket"])
def test_the_mover_offers_the_engines_arena_to_a_store_on_its_host(store, offered):
    client = MovedBlockStoreClient(store.target, timeout_s=10.0, store_shared_memory=offered)
    try:
        arena = client.open_arena(2 * BLOCK)
        arena[:BLOCK] = os.urandom(BLOCK)
        assert client.put(items(["m"])) == 1 and client.get(items(["m"], first_slot=1)) == [True]
        assert bytes(arena[BLOCK:]) == bytes(arena[:BLOCK])
        assert series(store)[SHARED] == (2 * BLOCK if offered else 0)
    finally:
        client.close()


def test_callers_of_one_mover_each_get_their_own_answers(store):
    """Replies come back in any order and are read by whichever caller waits:
    every caller must still get its own."""
    import threading

    client = MovedBlockStoreClient(store.target, timeout_s=10.0)
    client.open_arena(BLOCK)
    assert client.put(items(["only"])) == 1
    failures: list[str] = []

    def ask(n: int) -> None:
        for i in range(25):
            keys = ["only" if (n + i + j) % 3 == 0 else f"none-{n}-{i}-{j}" for j in range(n + 1)]
            want = [key == "only" for key in keys]
            got = client.exists(keys)
            if got != want:
                failures.append(f"caller {n} call {i}: {got} != {want}")
    try:
        threads = [threading.Thread(target=ask, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures[:3]
    finally:
        client.close()


def test_a_redis_backed_store_on_this_host_uses_shared_memory_too():
    from tests.support.redis_server import RedisServer

    with RedisServer() as redis:
        metrics_port = free_port()
        proc = start_store("--backend", redis.url, "--metrics-port", str(metrics_port))
        proc.metrics_port = metrics_port
        client, segment = shared_client(proc.target, 6)
        try:
            sent = bytes(segment.view[:3 * BLOCK])
            assert client.put(items(["r0", "r1", "r2"])) == 3
            assert client.get(items(["r0", "r1", "missing", "r2"], first_slot=2)) == [True, True, False, True]
            view = segment.view
            assert bytes(view[2 * BLOCK:4 * BLOCK]) == sent[:2 * BLOCK]
            assert bytes(view[5 * BLOCK:6 * BLOCK]) == sent[2 * BLOCK:]
            assert client._attached and series(proc)[SHARED] == 6 * BLOCK
        finally:
            client.close()
            segment.close()
            proc.stop()
