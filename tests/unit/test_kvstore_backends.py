"""The KV store's backends without the network in between: the memory backend's
LRU bounded by bytes, and the Redis backend against a real redis-server."""
from __future__ import annotations

import os

import time

import pytest

from tandem.services.kvstore.backends import (BackendUnavailable, MemoryBackend, RedisBackend,
                                              open_backend)
from tandem.services.kvstore.server import parse_size
from tandem.services.kvstore.value_slabs import MIN_SLOT_BYTES, ValueSlabs
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


# --- memory ----------------------------------------------------------------------------

def test_memory_round_trip_and_missing_keys():
    store = MemoryBackend(capacity_bytes=1000)
    assert store.put([("a", b"x" * 10), ("b", b"")]) == [True, True]
    assert store.get(["a", "missing", "b"]) == [b"x" * 10, None, b""]
    assert store.exists(["a", "missing", "b"]) == [True, False, True]
    stats = store.stats()
    assert (stats.backend, stats.bytes, stats.blocks, stats.capacity_bytes) == ("memory", 10, 2, 1000)
    assert (stats.hits, stats.misses, stats.evictions) == (2, 1, 0)


def test_memory_evicts_least_recently_used_first():
    store = MemoryBackend(capacity_bytes=30)
    store.put([("a", b"1" * 10), ("b", b"2" * 10), ("c", b"3" * 10)])
    store.get(["a"])  # a is now the most recent; b the least
    store.put([("d", b"4" * 10)])
    assert store.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    assert store.keys_lru_first() == ["c", "a", "d"]
    assert store.stats().evictions == 1


def test_memory_exists_does_not_refresh_recency():
    store = MemoryBackend(capacity_bytes=20)
    store.put([("a", b"1" * 10), ("b", b"2" * 10)])
    assert store.exists(["a"]) == [True]
    store.put([("c", b"3" * 10)])
    assert store.exists(["a", "b", "c"]) == [False, True, True]


def test_memory_stays_within_its_byte_bound_and_counts_every_eviction():
    store = MemoryBackend(capacity_bytes=1000)
    sizes = [137, 250, 999, 1, 400, 400, 400, 3, 1000, 64] * 5
    held: dict[str, int] = {}
    for i, size in enumerate(sizes):
        store.put([(f"k{i}", os.urandom(size))])
        stats = store.stats()
        assert stats.bytes <= 1000
        held = {k: len(v) for k, v in zip(store.keys_lru_first(), store.get(store.keys_lru_first()))}
        assert stats.bytes == sum(held.values())
    stats = store.stats()
    assert stats.evictions == len(sizes) - stats.blocks  # each put stored one new key


def test_memory_replacing_a_key_does_not_count_its_old_bytes():
    store = MemoryBackend(capacity_bytes=100)
    store.put([("a", b"x" * 60)])
    store.put([("a", b"y" * 80)])
    assert store.stats().bytes == 80
    assert store.stats().evictions == 0
    assert store.get(["a"]) == [b"y" * 80]


def test_memory_refuses_a_value_larger_than_its_capacity_without_evicting():
    store = MemoryBackend(capacity_bytes=100)
    store.put([("small", b"s" * 50)])
    assert store.put([("huge", b"h" * 101), ("fits", b"f" * 50)]) == [False, True]
    assert store.exists(["huge", "small", "fits"]) == [False, True, True]
    assert store.stats().evictions == 0


def test_memory_delete():
    store = MemoryBackend(capacity_bytes=100)
    store.put([("a", b"1" * 10), ("b", b"2" * 10)])
    assert store.delete(["a", "missing"]) == 1
    assert store.stats().bytes == 10
    assert store.get(["a"]) == [None]


def test_memory_rejects_a_non_positive_capacity():
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryBackend(capacity_bytes=0)


def test_open_backend_names_what_it_accepts():
    assert isinstance(open_backend("memory", 10), MemoryBackend)
    with pytest.raises(ValueError, match="redis://"):
        open_backend("memcached://x", 10)


def test_sizes_on_the_command_line():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512Mi") == 512 * 2**20
    assert parse_size("1GB") == 10**9
    assert parse_size("1.5KiB") == 1536
    assert parse_size("4096") == 4096
    for bad in ("", "lots", "2XB", "0"):
        with pytest.raises(Exception, match="size"):
            parse_size(bad)


# --- redis -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_backend(redis_server):
    backend = RedisBackend(redis_server.url)
    backend._client.flushdb()
    yield backend
    backend.close()


def test_redis_round_trip_in_batches(redis_backend):
    items = [(f"model/{i:04x}/0", os.urandom(1000 + i)) for i in range(50)]  # > one batch
    assert redis_backend.put(items) == [True] * 50
    keys = [k for k, _ in items]
    assert redis_backend.get(keys + ["model/none/0"]) == [v for _, v in items] + [None]
    assert redis_backend.exists(["model/none/0", keys[0], keys[-1]]) == [False, True, True]
    stats = redis_backend.stats()
    assert (stats.backend, stats.blocks, stats.hits, stats.misses) == ("redis", 50, 50, 1)
    assert stats.bytes > sum(len(v) for _, v in items)  # used_memory includes Redis's own
    assert redis_backend.delete(keys[:10] + ["model/none/0"]) == 10
    assert redis_backend.stats().blocks == 40


def test_redis_empty_value_is_found(redis_backend):
    redis_backend.put([("empty", b"")])
    assert redis_backend.get(["empty"]) == [b""]


def test_redis_down_raises_backend_unavailable_then_recovers(redis_server):
    backend = RedisBackend(redis_server.url)
    try:
        backend.put([("k", b"v")])
        redis_server.stop()
        with pytest.raises(BackendUnavailable, match="unreachable"):
            backend.get(["k"])
        with pytest.raises(BackendUnavailable):
            backend.stats()
        redis_server.start()
        # No persistence: the restarted Redis is empty, and the same backend works again.
        assert backend.get(["k"]) == [None]
        backend.put([("k", b"v2")])
        assert backend.get(["k"]) == [b"v2"]
    finally:
        backend.close()
        if not redis_server.running:
            redis_server.start()


def test_redis_pipelined_large_values_round_trip_intact(redis_backend):
    # More values than one SET pipeline or one GET pipeline, large enough to be
    # sent from their own buffers, given as bytes, bytearrays and memoryviews.
    n = RedisBackend.BATCH_KEYS * 2 + 3
    values = [os.urandom(300_000 + i) for i in range(n)]
    given = [v if i % 3 == 0 else bytearray(v) if i % 3 == 1 else memoryview(bytearray(v))
             for i, v in enumerate(values)]
    keys = [f"big/{i}" for i in range(n)]
    assert redis_backend.put(list(zip(keys, given))) == [True] * n
    asked = keys[:5] + ["big/none"] + keys[5:] + ["big/none2"]
    got = redis_backend.get(asked)
    assert [bytes(v) if v is not None else None for v in got] == values[:5] + [None] + values[5:] + [None]


def test_redis_get_buffers_handed_back_are_reused_and_overwritten(redis_backend):
    redis_backend.put([("a", b"1" * 100_000), ("b", b"2" * 100_000)])
    (first,) = redis_backend.get(["a"])
    redis_backend.release_values([first, None])
    (second,) = redis_backend.get(["b"])
    assert second is first and bytes(second) == b"2" * 100_000


def test_redis_a_key_of_another_type_is_refused_and_the_connection_stays_in_step(redis_backend):
    redis_backend._client.rpush("a-list", "x")
    redis_backend.put([("k1", b"v1"), ("k2", b"v2")])
    with pytest.raises(BackendUnavailable, match="refused"):
        redis_backend.get(["k1", "a-list", "k2"])
    assert redis_backend.get(["k2", "k1"]) == [b"v2", b"v1"]


def test_redis_a_get_stream_closed_early_leaves_the_backend_in_step(redis_backend):
    values = [os.urandom(200_000) for _ in range(6)]
    redis_backend.put([(f"s/{i}", v) for i, v in enumerate(values)])
    stream = redis_backend.iter_get([f"s/{i}" for i in range(6)])
    assert bytes(next(stream)) == values[0]  # later GETs are in flight now
    stream.close()  # e.g. the client went away mid-reply
    assert [bytes(v) for v in redis_backend.get(["s/5", "s/4"])] == [values[5], values[4]]


def test_redis_restarted_between_calls_is_reconnected_without_an_error(redis_server):
    backend = RedisBackend(redis_server.url)
    try:
        backend.put([("k", os.urandom(100_000))])
        assert backend.get(["k"])[0] is not None  # a pooled connection now exists
        redis_server.restart()  # that connection is dead; the first call's retry reconnects
        assert backend.get(["k"]) == [None]
        value = os.urandom(100_000)
        assert backend.put([("k", value)]) == [True]
        assert backend.get(["k"]) == [value]
    finally:
        backend.close()
        if not redis_server.running:
            redis_server.start()


def test_memory_backend_reuses_a_dropped_slot_but_never_one_still_being_read():
    size = MIN_SLOT_BYTES
    backend = MemoryBackend(capacity_bytes=8 * size)
    first = backend.take_buffer(size)
    first[:] = b"a" * size
    backend.put([("k", first)])
    del first
    held = backend.get(["k"])[0]  # a GET still sending it
    second = backend.take_buffer(size)
    second[:] = b"b" * size
    backend.put([("k", second)])
    del second
    assert bytes(held) == b"a" * size
    assert all(backend.take_buffer(size) is not held for _ in range(20))  # not back in the free list
    del held
    third = backend.take_buffer(size)
    third[:] = b"c" * size
    backend.put([("k", third)])  # the "b" slot: nobody refers to it now
    del third
    assert any(bytes(backend.take_buffer(size)[:4]) == b"bbbb" for _ in range(40))  # it came back
    assert bytes(backend.get(["k"])[0]) == b"c" * size
    backend.close()


def test_a_slot_evicted_while_read_comes_back_once_the_reader_lets_go():
    size = MIN_SLOT_BYTES
    backend = MemoryBackend(capacity_bytes=2 * size)
    for key, fill in (("a", b"a"), ("b", b"b")):
        value = backend.take_buffer(size)
        value[:] = fill * size
        backend.put([(key, value)])
    del value
    reading = backend.get(["a"])[0]  # a GET still sending "a"...
    for key, fill in (("c", b"c"), ("d", b"d")):  # ...when two more evict "b", then "a"
        value = backend.take_buffer(size)
        value[:] = fill * size
        backend.put([(key, value)])
    del value
    assert backend.get(["a"]) == [None] and bytes(reading) == b"a" * size
    assert all(bytes(backend.take_buffer(size)[:1]) != b"a" for _ in range(20))
    del reading  # the GET is done: the slot goes back to the slabs
    assert any(bytes(backend.take_buffer(size)[:4]) == b"aaaa" for _ in range(40))
    backend.close()


def test_value_slabs_are_faulted_in_ahead_and_bounded():
    size = MIN_SLOT_BYTES
    slabs = ValueSlabs(max_bytes=24 * size, slab_bytes=8 * size, ahead_bytes=16 * size)
    try:
        deadline = time.monotonic() + 10  # before any put: two slabs ready, faulted in
        while slabs.ready_bytes < 16 * size and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slabs.ready_bytes == 16 * size and slabs.slab_bytes == 16 * size
        first = slabs.take(size)  # cuts a ready slab into slots; a filler makes the third
        assert len(first) == size and isinstance(first, memoryview) and slabs.num_free == 7
        while slabs.slab_bytes < 24 * size and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slabs.slab_bytes == 24 * size  # and no more: max_bytes
        taken = [slabs.take(size) for _ in range(24)]  # the other 23 slots, then a fresh mapping
        assert slabs.slab_bytes == 24 * size and slabs.num_fresh == 1
        assert len({id(t) for t in taken}) == len(taken)
        assert all(slabs.give(t) for t in taken if isinstance(t, memoryview))
        assert not slabs.give(bytearray(size)) and not slabs.give(memoryview(bytearray(size)))
        assert isinstance(slabs.take(1000), bytearray)  # small values: plain buffers
    finally:
        slabs.close()
