"""Well-formed but hostile requests against `tandem up --prefill 2 --decode 2`:
every sampling field at its extremes (tiny, huge, NaN, inf, float32
subnormals), seeds at the int64 bounds, stop_token_ids over the whole
vocabulary, min_tokens above max_tokens, logprobs with n, over HTTP, the
public gRPC API and the engines' own RPCs.

After each one: a 4xx naming the field or a normal answer, and then every
engine instance, asked directly, still gives the right greedy answer, no
engine was restarted and none holds a KV block. One request used to kill
every engine in turn (the router retried it on the next) while /health
stayed green."""
from __future__ import annotations

import json
import math
import time

import grpc
import httpx
import pytest

from tandem.services.common.grpc_server import make_channel
from tandem.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc,
                       prefill_pb2, prefill_pb2_grpc)
from tests.support.stack import TWO_BY_TWO, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

TANDEM_STACK_OPTIONS = TWO_BY_TWO

VOCAB = 49152  # SmolLM2
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
SUBNORMAL = 1e-45
HI = [{"role": "user", "content": "hi"}]
# 32+ tokens once templated: through the prefill tier.
LONG = [{"role": "user", "content": "Tell me one short fact about the moon, in a single sentence please."}]


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": 4, **fields}


# (name, path, body, expected status, the field a 400 must name)
HTTP_CASES = [
    ("repetition_penalty subnormal", "chat", chat(temperature=1, repetition_penalty=SUBNORMAL), 400,
     "repetition_penalty"),
    ("repetition_penalty subnormal, through prefill", "chat",
     chat(messages=LONG, temperature=1, repetition_penalty=SUBNORMAL), 400, "repetition_penalty"),
    ("repetition_penalty tiny", "chat", chat(temperature=1, repetition_penalty=1e-30), 400,
     "repetition_penalty"),
    ("repetition_penalty huge", "chat", chat(temperature=1, repetition_penalty=1e30), 400,
     "repetition_penalty"),
    ("repetition_penalty zero", "chat", chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition_penalty at its top with a tiny temperature", "chat",
     chat(messages=LONG, temperature=0.01, repetition_penalty=100), 200, None),
    ("temperature subnormal", "chat", chat(temperature=SUBNORMAL), 400, "temperature"),
    ("temperature 1e-40", "chat", chat(temperature=1e-40), 400, "temperature"),
    ("temperature beyond float32", "chat", chat(temperature=1e39), 400, "temperature"),
    ("temperature huge", "chat", chat(temperature=1e6), 400, "temperature"),
    ("temperature 1e-6 is greedy", "chat", chat(temperature=1e-6), 200, None),
    ("temperature at its top", "chat", chat(temperature=100), 200, None),
    ("top_p subnormal", "chat", chat(temperature=1, top_p=SUBNORMAL), 400, "top_p"),
    ("top_p tiny keeps the top token", "chat", chat(temperature=1, top_p=1e-30), 200, None),
    ("min_p subnormal", "chat", chat(temperature=1, min_p=1e-39), 400, "min_p"),
    ("min_p one", "chat", chat(temperature=1, min_p=1.0), 200, None),
    ("frequency_penalty subnormal", "chat", chat(frequency_penalty=SUBNORMAL), 400, "frequency_penalty"),
    ("penalties at their bounds", "chat",
     chat(messages=LONG, temperature=1, presence_penalty=2, frequency_penalty=-2), 200, None),
    ("top_k at int32 max", "chat", chat(temperature=1, top_k=2**31 - 1), 200, None),
    ("top_k beyond int32", "chat", chat(top_k=2**31), 400, "top_k"),
    ("top_k -2", "chat", chat(top_k=-2), 400, "top_k"),
    ("seed int64 max with n", "chat", chat(temperature=1, n=2, seed=INT64_MAX), 200, None),
    ("seed int64 min with n, through prefill", "chat",
     chat(messages=LONG, temperature=1, n=3, seed=INT64_MIN), 200, None),
    ("seed beyond int64", "chat", chat(seed=INT64_MAX + 1), 400, "seed"),
    ("stop_token_ids over the vocabulary, min_tokens 2", "chat",
     chat(temperature=0.7, min_tokens=2, stop_token_ids=list(range(VOCAB))), 400, "min_tokens"),
    ("the same through prefill", "chat",
     chat(messages=LONG, temperature=0.7, min_tokens=2, stop_token_ids=list(range(VOCAB))), 400,
     "min_tokens"),
    ("stop_token_ids over the vocabulary stop at once", "chat",
     chat(temperature=0.7, stop_token_ids=list(range(VOCAB))), 200, None),
    ("stop_token_ids beyond the vocabulary", "chat", chat(stop_token_ids=[2**31 - 1]), 400,
     "stop_token_ids"),
    ("min_tokens above max_tokens", "chat", chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    ("min_tokens at int32 max", "chat", chat(min_tokens=2**31 - 1), 400, "min_tokens"),
    ("max_tokens at int32 max", "chat", chat(max_tokens=2**31 - 1), 400, "max_tokens"),
    ("logprobs with n", "chat", chat(temperature=1, n=4, logprobs=True, top_logprobs=20), 200, None),
    ("completion logprobs with n, through prefill", "completions",
     completion(prompt="word " * 40, temperature=1, n=3, logprobs=5), 200, None),
    ("n at its limit with a seed", "chat", chat(temperature=1, n=16, seed=7, max_tokens=2), 200, None),
    ("a 10k-character stop string", "chat", chat(stop=["x" * 10_000]), 200, None),
    ("the last token id of the vocabulary", "completions", completion(prompt=[VOCAB - 1]), 200, None),
    ("ignore_eos at temperature 1", "chat", chat(temperature=1, ignore_eos=True, max_tokens=8), 200, None),
]

NAN, INF = math.nan, math.inf


def gen_params(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 4, **fields})


# (name, GenerateRequest fields, expected code, field a refusal must name)
GRPC_CASES = [
    ("repetition_penalty NaN", {"params": gen_params(repetition_penalty=NAN)}, "INVALID_ARGUMENT",
     "repetition_penalty"),
    ("repetition_penalty subnormal", {"params": gen_params(temperature=1, repetition_penalty=SUBNORMAL)},
     "INVALID_ARGUMENT", "repetition_penalty"),
    ("temperature inf", {"params": gen_params(temperature=INF)}, "INVALID_ARGUMENT", "temperature"),
    ("temperature -inf", {"params": gen_params(temperature=-INF)}, "INVALID_ARGUMENT", "temperature"),
    ("top_p NaN", {"params": gen_params(top_p=NAN)}, "INVALID_ARGUMENT", "top_p"),
    ("min_p NaN", {"params": gen_params(min_p=NAN)}, "INVALID_ARGUMENT", "min_p"),
    ("presence_penalty inf", {"params": gen_params(presence_penalty=INF)}, "INVALID_ARGUMENT",
     "presence_penalty"),
    ("seed int64 max with n", {"params": gen_params(temperature=1, n=2, seed=INT64_MAX)}, "OK", None),
    ("seed int64 min with n", {"params": gen_params(temperature=1, n=3, seed=INT64_MIN)}, "OK", None),
    ("stop_token_ids over the vocabulary, min_tokens 2",
     {"params": gen_params(temperature=0.7, min_tokens=2, stop_token_ids=list(range(VOCAB)))},
     "INVALID_ARGUMENT", "min_tokens"),
    ("min_tokens above max_tokens", {"params": gen_params(min_tokens=9, max_tokens=3)}, "INVALID_ARGUMENT",
     "min_tokens"),
    ("n at int32 max", {"params": gen_params(n=2**31 - 1)}, "INVALID_ARGUMENT", "n"),
    ("logprobs with n", {"params": gen_params(temperature=1, n=2, logprobs=20)}, "OK", None),
]


# --- the oracle and the checks after each case ---------------------------------------

CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_TOKENS = 6


@pytest.fixture(scope="module")
def oracle():
    """Prompt ids and LLM.generate's greedy answer for the after-each check."""
    from tandem.engine import LLM, SamplingParams

    llm = LLM("smollm2")
    ids = llm.chat_prompt(CHECK_MESSAGES)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True))
    return ids, out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def engines(tandem_stack):
    """name -> (role, stub, pid at the start)."""
    out = {}
    channels = []
    for c in tandem_stack.children:
        if c["role"] not in ("prefill", "decode"):
            continue
        channel = make_channel(c["address"])
        channels.append(channel)
        stub = (prefill_pb2_grpc.PrefillServiceStub if c["role"] == "prefill"
                else decode_pb2_grpc.DecodeServiceStub)(channel)
        out[c["name"]] = (c["role"], stub, c["pid"])
    yield out
    for channel in channels:
        channel.close()


@pytest.fixture(scope="module")
def public(tandem_stack):
    channel = make_channel(tandem_stack.grpc_target)
    yield generate_pb2_grpc.TandemServiceStub(channel)
    channel.close()


_ids = iter(range(10**9))


def check_every_engine(stack, engines, oracle) -> None:
    """Each engine, asked directly, gives the greedy answer; then each holds
    no request and no block (free blocks back at the total; cached prefixes
    count as free)."""
    prompt, expected = oracle
    greedy = common_pb2.SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    for name, (role, stub, pid) in engines.items():
        rid = f"check-{next(_ids)}"
        if role == "prefill":
            reply = stub.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                                            params=greedy), timeout=60)
            assert reply.first_token_id == expected[0], name
        else:
            replies = list(stub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                                params=greedy), timeout=60))
            assert [t for r in replies for t in r.token_ids] == expected, name
    for c in stack.children:
        if c["name"] in engines:
            assert c["pid"] == engines[c["name"]][2], f"{c['name']} was restarted"
    deadline = time.monotonic() + 15
    while True:
        loads = {n: stub.GetLoad(common_pb2.LoadRequest(), timeout=10) for n, (_, stub, _) in engines.items()}
        idle = all(l.num_running == 0 and l.num_waiting == 0 and l.num_free_blocks == l.num_total_blocks
                   for l in loads.values())
        if idle:
            break
        assert time.monotonic() < deadline, f"an engine holds requests or blocks: {loads}"
        time.sleep(0.2)
    health = httpx.get(f"{stack.http_url}/health", timeout=10).json()
    assert health["instances"] == {"prefill": {"healthy": 2, "total": 2}, "decode": {"healthy": 2, "total": 2}}


def test_every_engine_answers_before_the_poison(tandem_stack, engines, oracle):
    check_every_engine(tandem_stack, engines, oracle)


@pytest.mark.parametrize("name,path,body,status,field", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_hostile_http_request(tandem_stack, engines, oracle, name, path, body, status, field):
    url = f"{tandem_stack.base_url}/{'chat/completions' if path == 'chat' else 'completions'}"
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert field in f"{error['param']} {error['message']}", error
    else:
        choices = r.json()["choices"]
        assert len(choices) == body.get("n", 1)
        assert all(c["finish_reason"] in ("stop", "length") for c in choices), choices
    check_every_engine(tandem_stack, engines, oracle)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_hostile_streaming_request(tandem_stack, engines, oracle, stream):
    """The first HTTP case again as a stream: the refusal comes before any event."""
    body = dict(HTTP_CASES[0][2], stream=stream)
    r = httpx.post(f"{tandem_stack.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and "repetition_penalty" in json.dumps(r.json())
    check_every_engine(tandem_stack, engines, oracle)


@pytest.mark.parametrize("name,fields,code,field", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_hostile_grpc_request(tandem_stack, engines, oracle, public, name, fields, code, field):
    request = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="user", content="hi")]), **fields)
    if code == "OK":
        replies = list(public.Generate(request, timeout=120))
        finished = [r for r in replies if r.finish_reason]
        assert len(finished) == (fields["params"].n or 1)
    else:
        with pytest.raises(grpc.RpcError) as info:
            list(public.Generate(request, timeout=120))
        assert info.value.code().name == code, info.value.details()
        assert field in info.value.details()
    check_every_engine(tandem_stack, engines, oracle)


def _first(engines, role):
    return next(stub for r, stub, _ in engines.values() if r == role)


@pytest.mark.parametrize("case", ["prefill NaN penalty", "decode subnormal penalty",
                                  "decode first token outside the vocabulary",
                                  "decode prompt outside the vocabulary"])
def test_hostile_internal_rpc(tandem_stack, engines, oracle, case):
    """The roles' own RPCs validate too: a router of another version, or a
    client that reaches them directly, gets INVALID_ARGUMENT."""
    prompt = oracle[0]
    rid = f"internal-{next(_ids)}"
    with pytest.raises(grpc.RpcError) as info:
        if case == "prefill NaN penalty":
            _first(engines, "prefill").Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, params=gen_params(repetition_penalty=NAN)), timeout=60)
        else:
            request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=gen_params())
            if case == "decode subnormal penalty":
                request.params.temperature, request.params.repetition_penalty = 1.0, SUBNORMAL
            elif case == "decode first token outside the vocabulary":
                request.first_token_ids.append(VOCAB + 5)
            else:
                request.prompt_token_ids.append(VOCAB + 5)
            list(_first(engines, "decode").Decode(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    check_every_engine(tandem_stack, engines, oracle)
