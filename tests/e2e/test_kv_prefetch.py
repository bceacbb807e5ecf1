"""A request whose KV is in the store waits for its fetch outside the batch:
while the store has not answered, the engine keeps stepping the requests it
runs; once the blocks are in, the request joins, computes only what the store
could not supply, and its greedy tokens equal a run without any store.

Engines in this process, the KV store a real process on loopback (KV moves
as bytes through it); tests/e2e/test_disaggregated.py covers prefill and
decode as separate processes."""
from __future__ import annotations

import threading
import time

import pytest

from tandem.engine import SamplingParams
from tandem.engine.connector.kvstore import WRITE_KEY
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.request import RequestStatus
from tandem.services.kvstore.block_client import BlockStoreClient
from tests.support.hf_oracle import tiny_model_dir
from tests.support.kvstore_process import start_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("tiny"), "llama")
    return path


@pytest.fixture(scope="module")
def store():
    proc = start_store("--backend", "memory", "--capacity", "64MiB")
    yield proc
    proc.stop()


def engine(model_dir: str, store_target: str | None, role: str = "both") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model_dir, dtype="float32"), cache=CacheConfig(num_blocks=256),
        device="cpu", kv_transfer="store" if store_target else None, kv_role=role),
        kv_store=BlockStoreClient(store_target, timeout_s=5.0) if store_target else None)


def run_to_end(eng: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
    return tokens


def prefill(eng: LLMEngine, request_id: str) -> tuple[list[int], dict]:
    """A prefill's first token and what it tells the decode of its KV."""
    tokens: list[int] = []
    params: dict = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                params = dict(out.kv_transfer_params)
    return tokens, params


def test_a_fetching_request_waits_outside_the_batch(model_dir, store):
    prompt = [(7 * i) % 400 + 5 for i in range(5 * BLOCK + 3)]
    producer = engine(model_dir, store.target, "producer")
    producer.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
    first, written = prefill(producer, "p")
    assert len(first) == 1
    assert written == {WRITE_KEY: (0, 5)}  # the prefill names the blocks it is writing

    consumer = engine(model_dir, store.target, "consumer")
    gate = threading.Event()
    real_get = consumer.connector.client.get

    def gated_get(keys):  # the real store answers, but only once the test lets it
        assert gate.wait(60), "the test never opened the gate"
        return real_get(keys)

    consumer.connector.client.get = gated_get
    consumer.add_request("running", [11, 12, 13], GREEDY)
    consumer.step()  # prefill of the short request; it decodes from now on
    consumer.add_request("fetching", prompt, GREEDY, first_token_ids=first, kv_transfer_params=written)
    fetching = consumer.scheduler.requests["fetching"]
    running = consumer.scheduler.requests["running"]
    outputs = consumer.step()
    # The prefill's token goes out at once (no model step needed for it).
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("fetching", first), ("running", outputs[1].new_token_ids)]
    for _ in range(2):
        outputs = consumer.step()
        assert [o.request_id for o in outputs] == ["running"]  # the batch steps without it
        assert fetching.status is RequestStatus.WAITING
    assert running.num_output_tokens == 4
    gate.set()
    got = first + run_to_end(consumer, "fetching")

    assert fetching.num_external_tokens == 5 * BLOCK  # loaded, not computed
    assert consumer.connector.stats.load_blocks == 5
    plain = engine(model_dir, None)
    plain.add_request("plain", prompt, GREEDY)  # max_tokens counts the first token on both sides
    assert got == run_to_end(plain, "plain")


def test_a_failed_fetch_means_recompute(model_dir):
    proc = start_store("--backend", "memory", "--capacity", "64MiB")
    target = proc.target
    consumer = engine(model_dir, target, "consumer")
    proc.stop()  # the store is gone before the request arrives
    prompt = [(11 * i) % 400 + 5 for i in range(4 * BLOCK + 1)]
    consumer.add_request("r", prompt, GREEDY)
    got = run_to_end(consumer, "r")
    assert consumer.connector.stats.lookup_failures == 1
    assert consumer.scheduler.stats.prefix_cache_queries == len(prompt)
    plain = engine(model_dir, None)
    plain.add_request("plain", prompt, GREEDY)
    assert got == run_to_end(plain, "plain")


def test_a_load_inside_the_step_still_works(model_dir, store):
    """The path for a request that was not prefetched (its local prefix hits
    shrank below where the fetch began): lookup and load inside the step."""
    prompt = [(13 * i) % 400 + 5 for i in range(3 * BLOCK + 2)]
    producer = engine(model_dir, store.target, "producer")
    producer.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
    first = run_to_end(producer, "p")
    producer.shutdown()  # its puts have landed: a load inside the step does not wait for writes
    consumer = engine(model_dir, store.target, "consumer")
    consumer.connector.prefetch = lambda request, num_local_hit_tokens: None
    consumer.add_request("r", prompt, GREEDY, first_token_ids=first)
    got = run_to_end(consumer, "r")  # decode's first output carries the prefill's token
    assert consumer.connector.stats.load_blocks == 3
    plain = engine(model_dir, None)
    plain.add_request("plain", prompt, GREEDY)
    assert got == run_to_end(plain, "plain")


def gate_puts(eng: LLMEngine) -> threading.Event:
    """Hold the engine's puts to the (real) store until the event is set."""
    gate = threading.Event()
    real_put = eng.connector.client.put

    def gated_put(items):
        assert gate.wait(60), "the test never opened the gate"
        return real_put(items)
    eng.connector.client.put = gated_put
    return gate


def test_a_decode_waits_for_blocks_its_prefill_is_still_writing(model_dir, store):
    """The prefill answers once its blocks are staged; the decode that asks
    before they land waits for them outside the batch, then loads them."""
    prompt = [(17 * i) % 400 + 5 for i in range(4 * BLOCK + 5)]
    producer = engine(model_dir, store.target, "producer")
    gate = gate_puts(producer)
    producer.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
    first, written = prefill(producer, "p")  # answered while every put is held
    assert written == {WRITE_KEY: (0, 4)}
    consumer = engine(model_dir, store.target, "consumer")
    consumer.add_request("d", prompt, GREEDY, first_token_ids=first, kv_transfer_params=written)
    waiting = consumer.scheduler.requests["d"]
    for _ in range(3):
        consumer.step()
        time.sleep(0.05)
        assert waiting.status is RequestStatus.WAITING and waiting.num_computed_tokens == 0
    gate.set()
    got = first + run_to_end(consumer, "d")
    assert waiting.num_external_tokens == 4 * BLOCK  # loaded once landed, not computed
    stats = consumer.connector.stats
    assert stats.load_blocks == 4 and stats.write_wait_seconds > 0.1 and stats.write_wait_timeouts == 0
    plain = engine(model_dir, None)
    plain.add_request("plain", prompt, GREEDY)
    assert got == run_to_end(plain, "plain")


def test_writes_that_never_land_in_time_are_recomputed(model_dir, store, monkeypatch):
    from tandem.engine.connector import kvstore

    monkeypatch.setattr(kvstore, "WRITE_WAIT_S", 0.3)
    prompt = [(19 * i) % 400 + 5 for i in range(3 * BLOCK + 2)]
    producer = engine(model_dir, store.target, "producer")
    gate = gate_puts(producer)
    producer.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
    first, written = prefill(producer, "p")
    consumer = engine(model_dir, store.target, "consumer")
    consumer.add_request("d", prompt, GREEDY, first_token_ids=first, kv_transfer_params=written)
    got = run_to_end(consumer, "d")  # its first output carries the prefill's token
    gate.set()
    stats = consumer.connector.stats
    assert stats.write_wait_timeouts == 1 and stats.load_blocks == 0
    plain = engine(model_dir, None)
    plain.add_request("plain", prompt, GREEDY)
    assert got == run_to_end(plain, "plain")


def test_the_staging_arena_has_the_room_the_engine_gives_it(model_dir, store):
    small = LLMEngine(EngineConfig(
        model=ModelConfig(model=model_dir, dtype="float32"), cache=CacheConfig(num_blocks=64),
        device="cpu", kv_transfer="store", kv_role="both", kv_staging_bytes=1 << 20),
        kv_store=BlockStoreClient(store.target, timeout_s=5.0))
    arena = small.connector.arena
    assert arena.num_slots == (1 << 20) // arena.slot_bytes
    assert engine(model_dir, store.target).connector.arena.num_slots > arena.num_slots  # the 1 GiB default
