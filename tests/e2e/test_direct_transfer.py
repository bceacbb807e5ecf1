"""Direct KV transfer on a real stack (`tandem up --kv-transfer direct`):
prefill and decode are separate processes, no KV store runs, and the decode
copies each prompt's blocks out of the prefill's shared-memory cache. Answers
equal the offline engine's, decode computes only the tail of each prompt, and
the prefill gets every block back once the router releases it."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import httpx
import openai
import pytest

from tandem.engine import LLM, SamplingParams
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.support.stack import StackOptions, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TANDEM_STACK_OPTIONS = StackOptions(prefill=1, decode=1, extra_args=("--kv-transfer", "direct"))
BLOCK = 16
POLL_S = 1.5  # engine metrics are polled every 0.5 s
MAX_TOKENS = 8
TOPICS = ["rain", "the moon", "bread", "a river", "music", "snow"]
CHATS = [[{"role": "system", "content": "You are a patient teacher who explains things simply. " * 3},
          {"role": "user", "content": f"In one sentence, what is {t}?"}] for t in TOPICS]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    offline = LLM("smollm2")
    prompts = [offline.chat_prompt(m) for m in CHATS]
    outs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs]


def by_source(stack, role: str) -> dict[str, float]:
    name = f"{role}-0"
    return {s: stack.metric(name, "tandem:prompt_tokens_by_source_total", source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def free_blocks_settle(stack, name: str, timeout_s: float = 15.0) -> tuple[float, float]:
    """(free, total) KV blocks of `name`, polled until every block is free or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = stack.metric(name, "tandem:kv_cache_free_blocks")
        total = stack.metric(name, "tandem:kv_cache_total_blocks")
        if free == total or time.monotonic() > deadline:
            return free, total
        time.sleep(0.5)


def test_no_kv_store_runs(tandem_stack):
    assert sorted(c["role"] for c in tandem_stack.children) == ["decode", "prefill", "router"]


def test_concurrent_chats_match_the_offline_engine(tandem_stack, expected):
    before = by_source(tandem_stack, "decode")

    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=tandem_stack.base_url, api_key="unused", max_retries=0, timeout=300)

        async def one(messages):
            r = await c.chat.completions.create(model=tandem_stack.model, messages=messages,
                                                max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].message.content
        return await asyncio.gather(*(one(m) for m in CHATS))

    assert asyncio.run(run()) == expected
    time.sleep(POLL_S)
    after = by_source(tandem_stack, "decode")
    # The chats share their system prompt, so after the first one decode finds
    # most of it in its own prefix cache; what it computes is only each tail.
    assert after["external_kv_transfer"] - before["external_kv_transfer"] >= 3 * BLOCK
    assert after["local_compute"] - before["local_compute"] < len(CHATS) * BLOCK
    assert tandem_stack.metric("decode-0", "tandem:kv_recompute_fallbacks_total") == 0


def test_decode_computes_only_the_tail_and_prefill_gets_its_blocks_back(tandem_stack):
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 20000) for _ in range(6 * BLOCK + 5)]
    before = by_source(tandem_stack, "decode")
    r = httpx.post(f"{tandem_stack.base_url}/completions", timeout=120, json={
        "model": tandem_stack.model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    time.sleep(POLL_S)
    after = by_source(tandem_stack, "decode")
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == 6 * BLOCK
    assert after["local_compute"] - before["local_compute"] == 5
    # The router released the hold after decode's first message: nothing stays taken.
    free, total = free_blocks_settle(tandem_stack, "prefill-0")
    assert free == total
    assert tandem_stack.metric("prefill-0", "tandem:kv_held_blocks") == 0


def test_decode_refuses_a_malformed_handle(tandem_stack):
    address = tandem_stack.child("decode-0")["address"]

    async def call(handle: common_pb2.KVHandle) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            request = decode_pb2.DecodeRequest(request_id="bad-handle", prompt_token_ids=[1, 2, 3],
                                               first_token_ids=[4], kv_handle=handle,
                                               params=common_pb2.SamplingParams(max_tokens=2))
            try:
                async for _ in stub.Decode(request):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    bad_shape = common_pb2.KVHandle(shape=[1, 2, 3], dtype="float32", data_shm="x")
    out_of_range = common_pb2.KVHandle(shape=[1, 2, 8, 16, 1, 64], dtype="float32", data_shm="x",
                                       block_ids=[9], generations=[1])
    foreign = common_pb2.KVHandle(shape=[1, 2, 8, 16, 1, 64], dtype="float32", data_shm="someone-elses",
                                  generations_shm="tandem-kv-x-gen", block_ids=[1], generations=[1])
    # A tensor-parallel prefill's other ranks: held to the same rules.
    foreign_rank = common_pb2.KVHandle(shape=[1, 2, 8, 16, 1, 64], dtype="float32", data_shm="tandem-kv-x-data",
                                       generations_shm="tandem-kv-x-gen", block_ids=[1], generations=[1],
                                       rank_caches=[common_pb2.KVRankCache(generations_shm="tandem-kv-y-gen",
                                                                           data_shm="someone-elses")])
    nothing_named = common_pb2.KVHandle(shape=[1, 2, 8, 16, 1, 64], dtype="float32", data_shm="tandem-kv-x-data",
                                        generations_shm="tandem-kv-x-gen", block_ids=[1], generations=[1],
                                        rank_caches=[common_pb2.KVRankCache(generations_shm="tandem-kv-y-gen")])
    for handle in (bad_shape, out_of_range, foreign, foreign_rank, nothing_named):
        assert asyncio.run(call(handle)) == grpc.StatusCode.INVALID_ARGUMENT
