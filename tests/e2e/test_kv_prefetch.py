"""A request whose KV is in the store waits for its fetch outside the batch:
while the store has not answered, the engine keeps stepping the requests it
runs; once the blocks are in, the request joins, computes only what the store
could not supply, and its greedy tokens equal a run without any store.

Engines in this process, the KV store a real process on loopback (KV moves
as bytes through it); tests/e2e/test_disaggregated.py covers prefill and
decode as separate processes."""
from __future__ import annotations

import threading

import pytest

from tandem.engine import SamplingParams
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


def test_a_fetching_request_waits_outside_the_batch(model_dir, store):
    prompt = [(7 * i) % 400 + 5 for i in range(5 * BLOCK + 3)]
    producer = engine(model_dir, store.target, "producer")
    producer.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
    first = run_to_end(producer, "p")
    assert len(first) == 1
    assert producer.connector.stats.save_blocks == 5

    consumer = engine(model_dir, store.target, "consumer")
    gate = threading.Event()
    real_get = consumer.connector.client.get

    def gated_get(keys):  # the real store answers, but only once the test lets it
        assert gate.wait(60), "the test never opened the gate"
        return real_get(keys)

    consumer.connector.client.get = gated_get
    consumer.add_request("running", [11, 12, 13], GREEDY)
    consumer.step()  # prefill of the short request; it decodes from now on
    consumer.add_request("fetching", prompt, GREEDY, first_token_ids=first)
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
    consumer = engine(model_dir, store.target, "consumer")
    consumer.connector.prefetch = lambda request, num_local_hit_tokens: None
    consumer.add_request("r", prompt, GREEDY, first_token_ids=first)
    got = run_to_end(consumer, "r")  # decode's first output carries the prefill's token
    assert consumer.connector.stats.load_blocks == 3
    plain = engine(model_dir, None)
    plain.add_request("plain", prompt, GREEDY)
    assert got == run_to_end(plain, "plain")
