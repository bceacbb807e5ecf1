"""Fuzzing the gateway's request schema against a real stack (hypothesis):
bodies whose fields are each valid or junk of any JSON type. Whatever comes
in, the answer is never a 5xx: a 200 with a well-formed answer, or a 4xx
with an OpenAI error naming what was wrong. Bounded: derandomized examples,
max_tokens kept tiny when valid, so it runs in about a minute."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
EXAMPLES = 120

scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
junk = st.one_of(scalar, st.lists(scalar, max_size=3), st.dictionaries(st.text(max_size=6), scalar, max_size=3))


def mostly(valid: st.SearchStrategy, bad: st.SearchStrategy, odds: int = 6) -> st.SearchStrategy:
    """`valid` odds times as often as `bad`: each field is junk now and then, so a
    fair share of whole requests gets past validation to the engines."""
    return st.integers(0, odds).flatmap(lambda k: valid if k else bad)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    return mostly(valid, junk)


# Never None or a large valid number: an unset max_tokens means "the rest of the context".
max_tokens = mostly(st.integers(1, 3), st.one_of(
    st.integers(-5, 0), st.integers(10**6, 2**40), st.text(max_size=3), st.floats(), st.booleans(),
    st.lists(st.integers(), max_size=2)))
role = mostly(st.sampled_from(["system", "user", "assistant", "developer"]), st.text(max_size=8))
STATUSES: list[int] = []  # every answer's status, to check that the fuzzing reached the engines
content = mostly(st.one_of(st.text(min_size=1, max_size=40),
                           st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                           "text": st.text(min_size=1, max_size=20)}),
                                    min_size=1, max_size=2)),
                 st.one_of(st.just(""), st.lists(st.fixed_dictionaries({"type": st.just("image_url")}),
                                                 max_size=1), junk))
message = mostly(st.fixed_dictionaries({"role": role, "content": content}), junk)

sampling = {
    "model": mostly(st.sampled_from([MODEL, "smollm2"]), st.one_of(st.just("gpt-4o"), junk)),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0, 1)),
    "top_k": field(st.integers(-2, 50)),
    "n": field(st.integers(0, 3)),
    "stream": field(st.booleans()),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5))),
    "seed": field(st.integers(-(2**64), 2**64)),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(0, 2)),
    "min_p": field(st.floats(0, 1)),
    "stop_token_ids": field(st.lists(st.integers(-2, 60000), max_size=3)),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": field(st.text(max_size=8)),
}

chat_body = st.fixed_dictionaries(
    {"messages": mostly(st.lists(message, min_size=1, max_size=3), st.one_of(st.just([]), junk)),
     "max_tokens": max_tokens},
    optional={**sampling, "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 25))})

prompt = mostly(st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=6),
                          st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2),
                          st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1,
                                   max_size=2)),
                st.one_of(st.lists(st.integers(-5, 10**6), max_size=6), st.just(""), junk))
completion_body = st.fixed_dictionaries(
    {"prompt": prompt, "max_tokens": max_tokens},
    optional={**sampling, "logprobs": field(st.integers(-1, 25)), "echo": field(st.booleans())})

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def check(http: httpx.Client, path: str, body: dict) -> None:
    raw = json.dumps(body)  # NaN and Infinity stay in: invalid JSON a client may still send
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    STATUSES.append(r.status_code)
    assert r.status_code < 500, f"{r.status_code} for {raw[:400]}: {r.text[:400]}"
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), r.text[-400:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert r.json()["choices"], r.text


@pytest.fixture(scope="module")
def http(tandem_stack):
    with httpx.Client(base_url=tandem_stack.base_url, timeout=120) as client:
        yield client


@FUZZ
@given(body=chat_body)
def test_fuzzed_chat_requests_never_get_a_5xx(http, body):
    check(http, "/chat/completions", body)


@FUZZ
@given(body=completion_body)
def test_fuzzed_completion_requests_never_get_a_5xx(http, body):
    check(http, "/completions", body)


def test_the_stack_is_healthy_after_fuzzing(tandem_stack):
    assert httpx.get(f"{tandem_stack.http_url}/health", timeout=10).status_code == 200
    # Not only rejections: a fair share of the fuzzed requests generated text.
    assert STATUSES.count(200) >= len(STATUSES) // 20, sorted(set(STATUSES))
