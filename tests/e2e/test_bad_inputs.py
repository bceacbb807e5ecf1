"""Bad input against a real stack, over HTTP and the public gRPC API: every
case gets the status that says what was wrong and a message naming the field,
the stack stays healthy, and no engine holds a KV block afterwards."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest

from tandem.services.common.grpc_server import make_channel
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Hello"}]


def chat(**overrides) -> dict:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not ...}


def completion(**overrides) -> dict:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not ...}


# (name, path, body: dict | raw bytes, status, a word the message or param must contain)
HTTP_CASES = [
    ("malformed json", "chat", b'{"model": "x", "messages": [', 400, "JSON"),
    ("json array body", "chat", b"[1, 2]", 400, "body"),
    ("empty body", "chat", b"", 400, "JSON"),
    ("invalid utf-8", "completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("oversize body", "completions", completion(prompt="x" * (5 * 1024 * 1024)), 413, "limit"),
    ("missing messages", "chat", chat(messages=...), 400, "messages"),
    ("messages not a list", "chat", chat(messages="hi"), 400, "messages"),
    ("empty messages", "chat", chat(messages=[]), 400, "messages"),
    ("message without role", "chat", chat(messages=[{"content": "hi"}]), 400, "role"),
    ("unknown role", "chat", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("content of wrong type", "chat", chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("content part not text", "chat",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), 400, "content"),
    ("max_tokens a string", "chat", chat(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens zero", "chat", chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", "chat", chat(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens over the context", "chat", chat(max_tokens=1_000_000), 400, "max_tokens"),
    ("prompt over the context", "chat",
     chat(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "context"),
    ("n zero", "chat", chat(n=0), 400, "n"),
    ("n over the limit", "chat", chat(n=17), 400, "n"),
    ("n a string", "chat", chat(n="2"), 400, "n"),
    ("negative temperature", "chat", chat(temperature=-1.0), 400, "temperature"),
    ("temperature a string", "chat", chat(temperature="hot"), 400, "temperature"),
    ("top_p zero", "chat", chat(top_p=0.0), 400, "top_p"),
    ("top_p over one", "chat", chat(top_p=1.5), 400, "top_p"),
    ("presence_penalty out of range", "chat", chat(presence_penalty=3.0), 400, "presence_penalty"),
    ("top_logprobs over the limit", "chat", chat(logprobs=True, top_logprobs=21), 400, "logprobs"),
    ("top_logprobs without logprobs", "chat", chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs not a boolean", "chat", chat(logprobs=5), 400, "logprobs"),
    ("stop of numbers", "chat", chat(stop=[1, 2]), 400, "stop"),
    ("stop with an empty string", "chat", chat(stop=["ok", ""]), 400, "stop"),
    ("too many stop strings", "chat", chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("negative stop_token_ids", "chat", chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("seed a string", "chat", chat(seed="7"), 400, "seed"),
    ("stream not a boolean", "chat", chat(stream="yes"), 400, "stream"),
    ("unknown model", "chat", chat(model="gpt-17"), 404, "model"),
    ("unknown model, streaming", "chat", chat(model="gpt-17", stream=True), 404, "model"),
    ("token ids outside the vocabulary", "completions", completion(prompt=[1, 2, 10**8]), 400, "prompt"),
    ("empty prompt", "completions", completion(prompt=""), 400, "prompt"),
    ("empty prompt list", "completions", completion(prompt=[]), 400, "prompt"),
    ("prompt an object", "completions", completion(prompt={"text": "hi"}), 400, "prompt"),
    ("missing prompt", "completions", completion(prompt=...), 400, "prompt"),
    ("completion logprobs over the limit", "completions", completion(logprobs=21), 400, "logprobs"),
    ("echo", "completions", completion(echo=True), 400, "echo"),
]

GRPC_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def params(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=2, **fields)


def chat_input(*messages: tuple[str, str]) -> generate_pb2.ChatMessages:
    return generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages])


# (name, request fields, status code, a word the details must contain)
GRPC_CASES = [
    ("no input", {}, GRPC_INVALID, "input"),
    ("empty prompt", {"prompt": ""}, GRPC_INVALID, "prompt"),
    ("empty chat", {"chat": chat_input()}, GRPC_INVALID, "messages"),
    ("unknown chat role", {"chat": chat_input(("wizard", "hi"))}, GRPC_INVALID, "role"),
    ("negative token id", {"token_ids": generate_pb2.TokenIds(ids=[-5])}, GRPC_INVALID, "token"),
    ("token id outside the vocabulary", {"token_ids": generate_pb2.TokenIds(ids=[10**8])}, GRPC_INVALID,
     "vocabulary"),
    ("negative temperature", {"prompt": "hi", "params": params(temperature=-1)}, GRPC_INVALID, "temperature"),
    ("max_tokens zero", {"prompt": "hi", "params": common_pb2.SamplingParams(max_tokens=0)}, GRPC_INVALID,
     "max_tokens"),
    ("max_tokens over the context", {"prompt": "hi", "params": common_pb2.SamplingParams(max_tokens=10**9)},
     GRPC_INVALID, "max_tokens"),
    ("n over the limit", {"prompt": "hi", "params": params(n=17)}, GRPC_INVALID, "n"),
    ("top_p over one", {"prompt": "hi", "params": params(top_p=2.0)}, GRPC_INVALID, "top_p"),
    ("logprobs over the limit", {"prompt": "hi", "params": params(logprobs=21)}, GRPC_INVALID, "logprobs"),
    ("stop with an empty string", {"prompt": "hi", "params": params(stop=[""])}, GRPC_INVALID, "stop"),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "model"),
    ("oversize message", {"prompt": "x" * (5 * 1024 * 1024)}, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger"),
]


def engines(stack) -> list[str]:
    return [c["name"] for c in stack.children if c["role"] in ("prefill", "decode")]


def free_blocks(stack) -> dict[str, tuple[float, float]]:
    return {n: (stack.metric(n, "tandem:kv_cache_free_blocks"), stack.metric(n, "tandem:kv_cache_total_blocks"))
            for n in engines(stack)}


@pytest.fixture(scope="module")
def blocks_before(tandem_stack) -> dict[str, tuple[float, float]]:
    before = free_blocks(tandem_stack)
    assert all(total > 0 for _, total in before.values()), before
    return before


@pytest.fixture(scope="module")
def stub(tandem_stack):
    channel = make_channel(tandem_stack.grpc_target)
    yield generate_pb2_grpc.TandemServiceStub(channel)
    channel.close()


def assert_healthy(stack) -> None:
    r = httpx.get(f"{stack.http_url}/health", timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name,path,body,status,word", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_bad_http_input_gets_an_openai_error(tandem_stack, blocks_before, name, path, body, status, word):
    url = f"{tandem_stack.base_url}/{'chat/completions' if path == 'chat' else 'completions'}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    assert word in f"{error['param']} {error['message']}", error
    assert "Traceback" not in error["message"]
    assert_healthy(tandem_stack)


@pytest.mark.parametrize("name,fields,code,word", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_bad_grpc_input_gets_a_status_code(tandem_stack, blocks_before, stub, name, fields, code, word):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=60))
    assert info.value.code() == code, info.value.details()
    assert word in info.value.details()
    assert_healthy(tandem_stack)


def test_stack_still_serves_and_holds_no_blocks(tandem_stack, blocks_before, stub):
    r = httpx.post(f"{tandem_stack.base_url}/chat/completions", json=chat(max_tokens=3), timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    replies = list(stub.Generate(generate_pb2.GenerateRequest(prompt="Hello", params=params()), timeout=120))
    assert replies[-1].finish_reason == "length"
    deadline = time.monotonic() + 10  # engine metrics are polled every 0.5 s
    while (after := free_blocks(tandem_stack)) != blocks_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert after == blocks_before
