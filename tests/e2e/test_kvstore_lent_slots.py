"""The KV store lends its own memory to an engine on its host: a real store
process, whose slabs are /dev/shm segments, and the engine's client of them
(LentSlots). A reserved slot is invisible until committed and then a whole
value, readable over the socket too; a pinned value stays put while it is
pinned although the store evicts and reuses around it; a connection that
ends drops what it reserved; slabs whose token is not the store's are never
used; a killed store's slabs are removed by the next store; the engine maps
slabs before any slot of them is lent (all of a preallocating store's before
it serves); reservations beyond the slabs' slack evict the oldest values."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tandem.services.kvstore.block_client import BlockStoreClient
from tandem.services.kvstore.client import KVStoreClient
from tandem.services.kvstore.lent_slots import LentSlots
from tandem.services.kvstore.value_slabs import SHM_DIR, SLAB_PREFIX
from tests.support.kvstore_process import start_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

VALUE = 300_000  # bytes of one value: above a slot's size class minimum, several to a slab


@pytest.fixture
def store():
    proc = start_store("--backend", "memory", "--capacity", "16MiB")
    yield proc
    proc.stop()


def slabs_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SLAB_PREFIX}{pid}-")]


def mapping_client(target: str) -> tuple[LentSlots, list[str]]:
    """A client, and the phases it reports as it maps the store's slabs (one "slots_map" each)."""
    mapped: list[str] = []
    return LentSlots(target, observe=lambda phase, seconds: mapped.append(phase)), mapped


def lent_put(slots: LentSlots, keys: list[str], fill: bytes) -> int:
    lease = slots.reserve(keys, VALUE)
    assert lease.num_lent == len(keys)
    for view in lease.views:
        view[:] = fill
    return lease.commit()


def test_a_reserved_slot_becomes_a_whole_value_only_once_committed(store):
    slots, control = LentSlots(store.target), KVStoreClient(store.target)
    reader = BlockStoreClient(store.target)
    reader.open_arena(VALUE)
    try:
        assert slots.usable()
        lease = slots.reserve(["a", "b"], VALUE)
        assert lease.num_lent == 2
        lease.views[0][:] = b"\x11" * VALUE
        lease.views[1][:] = b"\x22" * VALUE
        assert control.exists(["a", "b"]) == [False, False]  # filled, not committed: nobody sees it
        assert lease.commit() == 2
        assert control.exists(["a", "b"]) == [True, True]
        assert reader.get([("b", 0, VALUE)]) == [True]  # the same value over the data channel
        assert bytes(reader.arena) == b"\x22" * VALUE

        pinned = slots.pin(["a", "missing", "b"], VALUE)
        assert [v is not None for v in pinned.views] == [True, False, True]
        assert bytes(pinned.views[0]) == b"\x11" * VALUE
        assert slots.pin(["a"], VALUE - 1).num_lent == 0  # another length: not this value
        pinned.release()
    finally:
        slots.close(), control.close(), reader.close()


def test_a_pinned_value_stays_put_while_the_store_evicts_and_reuses_around_it(store):
    slots, control = LentSlots(store.target), KVStoreClient(store.target)
    try:
        assert lent_put(slots, ["kept"], b"\x5a" * VALUE) == 1
        pinned = slots.pin(["kept"], VALUE)
        assert pinned.num_lent == 1
        # Replace it, then write four times the store's capacity: every other slot is reused.
        assert lent_put(slots, ["kept"], b"\x01" * VALUE) == 1
        for i in range(4 * 16 * 2**20 // VALUE):
            assert lent_put(slots, [f"filler-{i}"], bytes([i % 251]) * VALUE) == 1
        assert bytes(pinned.views[0]) == b"\x5a" * VALUE  # the old value, untouched
        pinned.release()
        assert control.exists(["kept"]) == [False]  # the replacement was evicted like any value
    finally:
        slots.close(), control.close()


def test_a_reservation_never_committed_is_never_seen(store):
    slots, control = LentSlots(store.target), KVStoreClient(store.target)
    try:
        lease = slots.reserve(["dropped", "released"], VALUE)
        lease.views[0][:] = b"\x33" * VALUE
        lease.release()
        assert control.exists(["dropped", "released"]) == [False, False]
        lease = slots.reserve(["cut"], VALUE)
        lease._sock.close()  # the engine's connection ends mid-save (its process died)
        with pytest.raises(Exception):
            lease.commit()
        assert control.exists(["cut"]) == [False]
    finally:
        slots.close(), control.close()


def test_slabs_that_are_not_the_stores_are_never_used(store):
    slots = LentSlots(store.target)
    try:
        assert lent_put(slots, ["x"], b"\x44" * VALUE) == 1
        # What an engine in another pod would find: a segment of that name, another token. (The
        # slabs this client mapped: a slab the store is making at this moment has no token yet.)
        for name in [slab.name for slab in slots._slabs.values()]:
            with open(os.path.join(SHM_DIR, name), "r+b") as f:
                f.seek(-16, os.SEEK_END)
                f.write(bytes(16))
        stranger = LentSlots(store.target)
        try:
            assert not stranger.usable()
        finally:
            stranger.close()
    finally:
        slots.close()


def test_a_store_without_shared_slabs_lends_nothing():
    proc = start_store("--backend", "memory", "--capacity", "16MiB", "--no-shared-slabs")
    slots = LentSlots(proc.target)
    try:
        assert not slots.usable()
        assert slabs_of(proc.process.pid) == []
    finally:
        slots.close()
        proc.stop()


def test_a_killed_stores_slabs_are_removed_by_the_next_store():
    first = start_store("--backend", "memory", "--capacity", "16MiB")
    slots = LentSlots(first.target)
    try:
        assert lent_put(slots, ["y"], b"\x55" * VALUE) == 1
    finally:
        slots.close()
    assert slabs_of(first.process.pid)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    first.stop()
    assert slabs_of(first.process.pid)  # a killed store cannot remove its own
    second = start_store("--backend", "memory", "--capacity", "16MiB")
    try:
        assert slabs_of(first.process.pid) == []
    finally:
        pid = second.process.pid
        second.stop()
    assert slabs_of(pid) == []  # a store that stops removes its own


def test_the_engine_maps_the_stores_ready_slabs_before_any_slot_of_them_is_lent(store):
    # Mapping and page-locking a slab is slow on a GPU host: it must happen off the leases' path.
    slots, mapped = mapping_client(store.target)
    try:
        assert slots.usable()
        deadline = time.monotonic() + 5
        while not mapped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mapped and set(mapped) == {"slots_map"}  # no lease asked yet
        ahead = len(mapped)
        assert lent_put(slots, ["z"], b"\x66" * VALUE) == 1
        assert len(mapped) == ahead  # the slot lent lay in a slab already mapped
    finally:
        slots.close()


def test_a_preallocated_store_has_all_its_slabs_before_the_first_put():
    proc = start_store("--backend", "memory", "--capacity", "16MiB", "--preallocate")
    slots, mapped = mapping_client(proc.target)
    try:
        assert slots.usable()
        deadline = time.monotonic() + 10
        while len(mapped) < 16 and time.monotonic() < deadline:  # 1 MiB slabs for a 16 MiB store
            time.sleep(0.05)
        assert len(mapped) >= 16
    finally:
        slots.close()
        proc.stop()


def test_an_engine_maps_all_of_a_preallocating_store_before_it_serves():
    proc = start_store("--backend", "memory", "--capacity", "64MiB", "--preallocate")
    slots, mapped = mapping_client(proc.target)
    try:
        assert slots.map_all(timeout_s=30)  # waits while the store allocates (4 MiB slabs)
        assert len(mapped) == 64 // 4 + 4  # the capacity and the four slabs over it the store allows
    finally:
        slots.close()
        proc.stop()
    grower = start_store("--backend", "memory", "--capacity", "64MiB")
    slots = LentSlots(grower.target)
    try:
        assert not slots.map_all(timeout_s=30)  # a store that grows with its values is never all mapped
    finally:
        slots.close()
        grower.stop()


def test_reservations_beyond_the_stores_slack_evict_the_oldest_values(store):
    # 16 MiB of capacity in 1 MiB slabs of three values each, 20 slabs at most: 60 slots, a few
    # more than the 53 values the capacity holds. 48 reservations at once, uncommitted, beside 40
    # values must make room by evicting the oldest, not fail.
    slots, control = LentSlots(store.target), KVStoreClient(store.target)
    try:
        for i in range(40):
            assert lent_put(slots, [f"old-{i}"], bytes([i]) * VALUE) == 1
        pinned = slots.pin(["old-39"], VALUE)  # the newest: not evicted by what follows
        held = [slots.reserve([f"new-{i}-{j}" for j in range(8)], VALUE) for i in range(6)]
        assert all(lease.num_lent == 8 for lease in held)
        assert not any(control.exists([f"old-{i}" for i in range(20)]))  # the oldest made room
        assert bytes(pinned.views[0]) == bytes([39]) * VALUE
        for lease in held:
            lease.release()
        pinned.release()
    finally:
        slots.close(), control.close()
