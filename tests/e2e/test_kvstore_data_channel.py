"""The KV store's bulk data channel, against a real store process: blocks go
from the client's arena to the store and back bit for bit; a missing key or
a value of another size is a miss, not a misread; a value whose bytes are
still arriving is never seen half-written; a store that goes away is
KVStoreUnavailable and a restarted one is found again; with the channel off
the client falls back to gRPC; with TLS the channel speaks TLS."""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from tandem.services.common.grpc_server import TLSConfig
from tandem.services.kvstore import data_wire as wire
from tandem.services.kvstore.block_client import BlockStoreClient
from tandem.services.kvstore.client import KVStoreClient, KVStoreUnavailable
from tests.support.kvstore_process import start_store
from tests.support.ports import free_port
from tests.support.tls import make_certs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

BLOCK = 300_000  # bytes of one value: several TCP segments, not a multiple of anything


def arena_client(target: str, blocks: int, **kwargs) -> BlockStoreClient:
    client = BlockStoreClient(target, timeout_s=10.0, **kwargs)
    arena = client.open_arena(blocks * BLOCK)
    arena[:] = os.urandom(len(arena))
    return client


def items(keys: list[str], first_slot: int = 0, size: int = BLOCK) -> list[tuple[str, int, int]]:
    return [(key, (first_slot + i) * BLOCK, size) for i, key in enumerate(keys)]


@pytest.fixture
def store():
    proc = start_store("--backend", "memory", "--capacity", "64MiB")
    yield proc
    proc.stop()


def test_blocks_round_trip_through_the_data_channel(store):
    writer = arena_client(store.target, 4)
    assert KVStoreClient(store.target).stats().data_port > 0
    keys = ["a", "b", "c"]
    assert writer.put(items(keys)) == 3
    assert writer.exists(keys + ["nope"]) == [True, True, True, False]
    reader = arena_client(store.target, 4)
    assert reader.get(items(["c", "nope", "a"], first_slot=1)) == [True, False, True]
    assert reader.arena[BLOCK:2 * BLOCK] == writer.arena[2 * BLOCK:3 * BLOCK]  # c
    assert reader.arena[3 * BLOCK:4 * BLOCK] == writer.arena[0:BLOCK]  # a
    # A value of another size (another model's block) is a miss, and the connection goes on.
    assert reader.get(items(["b"], size=BLOCK - 8)) == [False]
    assert reader.get(items(["b"])) == [True]
    # ... also before other values in one get: they are read whole after it.
    reader.arena[:] = bytes(len(reader.arena))
    assert reader.get([("b", 0, BLOCK - 8), ("nope", BLOCK, BLOCK), ("a", 2 * BLOCK, BLOCK)]) == [False, False, True]
    assert reader.arena[2 * BLOCK:3 * BLOCK] == writer.arena[0:BLOCK]


def test_a_value_still_arriving_is_never_seen_half_written(store):
    client = arena_client(store.target, 2)
    port = KVStoreClient(store.target).stats().data_port
    value = os.urandom(BLOCK)
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(wire.request_header(wire.OP_PUT, ["racing"]) + wire.VALUE_LEN.pack(BLOCK) + value[:BLOCK // 2])
        time.sleep(0.2)  # the store holds half the value now
        assert client.exists(["racing"]) == [False]
        assert client.get(items(["racing"])) == [False]
        slow.sendall(value[BLOCK // 2:])
        assert wire.recv_exactly(slow, 1) == wire.OK
        assert struct.unpack("<II", wire.recv_exactly(slow, 8)) == (1, 0)
    assert client.get(items(["racing"])) == [True]
    assert client.arena[:BLOCK] == value


def test_a_store_that_goes_away_is_unavailable_and_found_again_after_its_restart():
    grpc_port, data_port = free_port(), free_port()
    flags = ("--port", str(grpc_port), "--data-port", str(data_port), "--backend", "memory")
    proc = start_store(*flags)
    try:
        target = f"127.0.0.1:{grpc_port}"
        client = arena_client(target, 2)
        assert client.put(items(["k"])) == 1
        proc.stop()
        with pytest.raises(KVStoreUnavailable):
            client.get(items(["k"]))
        proc = start_store(*flags)
        assert client.put(items(["k"])) == 1 and client.get(items(["k"], first_slot=1)) == [True]
        assert client.arena[BLOCK:] == client.arena[:BLOCK]
    finally:
        proc.stop()


def test_without_a_data_channel_the_client_uses_grpc():
    proc = start_store("--backend", "memory", "--data-port", "-1")
    try:
        assert KVStoreClient(proc.target).stats().data_port == 0
        client = arena_client(proc.target, 3)
        assert client.put(items(["g"])) == 1
        assert client.get(items(["g", "missing"], first_slot=1)) == [True, False]
        assert client.arena[BLOCK:2 * BLOCK] == client.arena[:BLOCK]
    finally:
        proc.stop()


def test_with_tls_the_data_channel_speaks_tls(tmp_path):
    certs = make_certs(str(tmp_path))
    proc = start_store("--backend", "memory", "--tls-cert", certs.node_cert, "--tls-key", certs.node_key,
                       "--tls-ca", certs.ca)
    try:
        tls = TLSConfig(cert_file=certs.node_cert, key_file=certs.node_key, ca_file=certs.ca)
        client = arena_client(proc.target, 2, tls=tls)
        assert client.put(items(["t"])) == 1
        assert client.get(items(["t"], first_slot=1)) == [True]
        assert client.arena[BLOCK:] == client.arena[:BLOCK]
        # Plaintext is refused on the channel: its first bytes are no TLS handshake.
        port = client._port()
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(wire.request_header(wire.OP_EXISTS, ["t"]))
            raw.settimeout(5)
            try:
                answer = raw.recv(1)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed, never answered
    finally:
        proc.stop()


def test_a_mover_process_moves_the_bytes_through_shared_memory(store):
    from tandem.services.kvstore.mover import MovedBlockStoreClient

    client = MovedBlockStoreClient(store.target, timeout_s=10.0)
    try:
        arena = client.open_arena(3 * BLOCK)
        arena[:BLOCK] = os.urandom(BLOCK)
        assert client._local is None and client._process.poll() is None  # shared memory, a child moves bytes
        assert client.put(items(["m"])) == 1 and client.exists(["m", "x"]) == [True, False]
        assert client.get(items(["m", "x"], first_slot=1)) == [True, False]
        assert arena[BLOCK:2 * BLOCK] == arena[:BLOCK]
        client._process.kill()  # the mover dies: calls fail fast, the connector recomputes
        client._process.wait()
        with pytest.raises(KVStoreUnavailable):
            client.get(items(["m"]))
    finally:
        client.close()


def test_without_room_in_dev_shm_the_bytes_move_in_this_process(store, monkeypatch):
    from tandem.services.kvstore import mover, shared_arena

    def no_room(nbytes):
        raise ValueError("/dev/shm has 0 MiB free")

    monkeypatch.setattr(shared_arena, "_check_room", no_room)
    client = mover.MovedBlockStoreClient(store.target, timeout_s=10.0)
    try:
        arena = client.open_arena(2 * BLOCK)
        assert client._local is not None and client._process is None
        arena[:BLOCK] = os.urandom(BLOCK)
        assert client.put(items(["l"])) == 1 and client.get(items(["l"], first_slot=1)) == [True]
        assert arena[BLOCK:] == arena[:BLOCK]
    finally:
        client.close()


def test_with_redis_blocks_stream_through_intact_and_a_redis_restart_is_unavailable_then_recovers():
    # More blocks than the Redis backend keeps in flight and than one SET pipeline,
    # misses between hits, then Redis restarted under a connected client.
    from tests.support.redis_server import RedisServer

    with RedisServer() as redis:
        proc = start_store("--backend", redis.url)
        try:
            n = 40
            writer = arena_client(proc.target, n)
            keys = [f"r/{i}" for i in range(n)]
            assert writer.put(items(keys)) == n
            reader = arena_client(proc.target, n + 2)
            asked = keys[:7] + ["r/none"] + keys[7:] + ["r/none2"]
            found = reader.get(items(asked))
            assert found == [True] * 7 + [False] + [True] * (n - 7) + [False]
            assert reader.arena[:7 * BLOCK] == writer.arena[:7 * BLOCK]
            assert reader.arena[8 * BLOCK:(n + 1) * BLOCK] == writer.arena[7 * BLOCK:n * BLOCK]

            redis.restart()  # empty now; every pooled connection of the store is dead
            assert reader.get(items(keys[:3])) == [False] * 3  # reconnected, nothing lost but the data
            redis.stop()
            with pytest.raises(KVStoreUnavailable, match="Redis"):
                reader.get(items(keys[:3]))
            with pytest.raises(KVStoreUnavailable, match="Redis"):
                writer.put(items(keys[:3]))
            redis.start()
            assert writer.put(items(keys[:3])) == 3
            assert reader.get(items(keys[:3])) == [True] * 3
            assert reader.arena[:3 * BLOCK] == writer.arena[:3 * BLOCK]
        finally:
            proc.stop()
