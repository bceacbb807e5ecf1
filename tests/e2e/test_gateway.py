"""The OpenAI-compatible gateway of a real stack (`tandem up`: kvstore,
prefill, decode, router as processes on loopback) driven by the real `openai`
client, checked against the offline engine on the same model."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tandem.engine import LLM, SamplingParams
from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = 10

# 16 chats (all over --prefill-threshold, 32 tokens, with the chat template:
# they go through the prefill tier; short prompts are in the completions test).
LONG_SYSTEM = "You are a patient teacher who explains things simply and briefly. " * 2
TOPICS = ["rain", "the moon", "bread", "a river", "music", "snow", "a bridge", "tea"]
CHATS = ([[{"role": "user", "content": f"Say one thing about {t}."}] for t in TOPICS]
         + [[{"role": "system", "content": LONG_SYSTEM},
             {"role": "user", "content": f"In one sentence, what is {t}?"}] for t in TOPICS])


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("smollm2")


@pytest.fixture(scope="module")
def expected(offline) -> list[str]:
    prompts = [offline.chat_prompt(m) for m in CHATS]
    outs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs]


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)


async def chat_text(c: openai.AsyncOpenAI, model: str, messages: list[dict], stream: bool) -> str:
    if not stream:
        r = await c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0)
        return r.choices[0].message.content
    parts = []
    async for chunk in await c.chat.completions.create(model=model, messages=messages,
                                                       max_tokens=MAX_TOKENS, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def test_concurrent_chats_match_the_offline_engine(tandem_stack, expected):
    async def run(stream: bool) -> list[str]:
        c = client(tandem_stack)
        return await asyncio.gather(*(chat_text(c, tandem_stack.model, m, stream) for m in CHATS))

    assert asyncio.run(run(stream=False)) == expected
    assert asyncio.run(run(stream=True)) == expected
    assert tandem_stack.metric("router", "tandem:router_routing_decisions_total", target_role="prefill") >= 32


def test_streaming_usage_and_finish_reason(tandem_stack):
    async def run():
        c = client(tandem_stack)
        chunks = [ch async for ch in await c.chat.completions.create(
            model=tandem_stack.model, messages=CHATS[8], max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        return chunks

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 5
    assert usage.prompt_tokens > 32 and usage.total_tokens == usage.prompt_tokens + 5


def test_n_choices_and_logprobs(tandem_stack, expected):
    async def run():
        return await client(tandem_stack).chat.completions.create(
            model=tandem_stack.model, messages=CHATS[9], max_tokens=MAX_TOKENS, temperature=0, n=2,
            logprobs=True, top_logprobs=2)

    r = asyncio.run(run())
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.message.content == expected[9]  # greedy: every choice is the same
        tokens = choice.logprobs.content
        assert len(tokens) == r.usage.completion_tokens // 2
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
        # The chosen token is the most likely one under greedy decoding.
        assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4 for t in tokens)
    assert r.usage.completion_tokens == 2 * MAX_TOKENS


def test_short_completion_skips_prefill_and_streams_the_same_text(tandem_stack, offline):
    prompt = "The three primary colors are"
    skipped_before = tandem_stack.metric("router", "tandem:router_prefill_skipped_total")

    async def run():
        c = client(tandem_stack)
        kwargs = dict(model=tandem_stack.model, prompt=prompt, max_tokens=8, temperature=0)
        whole = await c.completions.create(**kwargs)
        parts = [ch.choices[0].text async for ch in await c.completions.create(stream=True, **kwargs)
                 if ch.choices]
        return whole, "".join(parts)

    whole, streamed = asyncio.run(run())
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert whole.choices[0].text == streamed == want and whole.usage.completion_tokens == 8
    # A 6-token prompt is under --prefill-threshold: decode prefilled it itself.
    assert tandem_stack.metric("router", "tandem:router_prefill_skipped_total") >= skipped_before + 2


def test_models_and_health(tandem_stack):
    models = httpx.get(f"{tandem_stack.base_url}/models").json()["data"]
    assert [m["id"] for m in models] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert httpx.get(f"{tandem_stack.http_url}/health").json()["status"] == "ok"


def test_client_disconnect_aborts_the_request_in_decode(tandem_stack):
    decode = [c["name"] for c in tandem_stack.children if c["role"] == "decode"]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{tandem_stack.base_url}/chat/completions", json={
                "model": tandem_stack.model, "messages": CHATS[0], "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leave mid-stream
    deadline = time.monotonic() + 20
    running = None
    while time.monotonic() < deadline:
        running = sum(tandem_stack.metric(d, "tandem:num_requests_running") for d in decode)
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0, "the abandoned request still runs in decode"
    assert tandem_stack.metric("router", "tandem:router_requests_total", status="499") >= 1
