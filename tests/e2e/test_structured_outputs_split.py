"""Structured outputs through `tandem up` with prefill and decode split (the
prompts are above the prefill threshold, so the prefill samples the first
token under the grammar and the decode rebuilds the grammar over it), with
the real `openai` client: fifty JSON schemas, every answer parses and
validates; regex, choice and an EBNF grammar; the same fifty with the KV
store stopped (the decode recomputes the prompt). Each schema is asked once
streamed and once not, one of the two through the store."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.support.json_schemas import SCHEMAS, prompt_for
from tests.support.stack import StackOptions, owned_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

MAX_TOKENS = 200
CONCURRENCY = 16


@pytest.fixture(scope="module")
def stack():
    # Private: the last test stops the KV store.
    yield from owned_stack(StackOptions(prefill=1, decode=1, private=True, extra_args=("--num-blocks", "600")))


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=600)


def _ask(client, schema: dict, stream: bool) -> tuple[str, str]:
    kwargs = dict(model="smollm2", temperature=0, max_tokens=MAX_TOKENS,
                  messages=[{"role": "user", "content": prompt_for(schema)}],
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _check_all(client, cases: list[tuple[dict, bool]]) -> None:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda c: _ask(client, *c), cases))
    bad = []
    for (schema, stream), (text, reason) in zip(cases, answers):
        try:
            assert reason == "stop", f"finish_reason {reason}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            bad.append(f"{schema['title']} (stream={stream}): {text!r}: {str(exc)[:200]}")
    assert not bad, "\n".join(bad)


def _prefill_computed(stack) -> float:
    names = [c["name"] for c in stack.children if c["role"] == "prefill"]
    return sum(stack.metric(n, "tandem:prompt_tokens_by_source_total", source="local_compute") for n in names)


def test_fifty_json_schemas_through_the_split(stack, client):
    before = _prefill_computed(stack)
    # Each schema once, streamed or not in turn; the last test asks the other way round.
    _check_all(client, [(s, i % 2 == 0) for i, s in enumerate(SCHEMAS)])
    assert _prefill_computed(stack) > before, "the prompts did not go through the prefill tier"


def test_regex_choice_and_grammar(client):
    regex = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    # Bounded (at most five terms), so an answer ends by the grammar, never by max_tokens.
    arithmetic = ('root ::= expr\nexpr ::= term (("+" | "-" | "*" | "/") term){0,4}\n'
                  'term ::= number | "(" number (("+" | "-") number){1,2} ")"\n'
                  'number ::= [1-9] [0-9]{0,2}\n')
    ask = "Write a short answer. " * 6  # above the prefill threshold

    def chat(extra: dict, max_tokens: int = 40) -> str:
        return client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=max_tokens, extra_body=extra,
            messages=[{"role": "user", "content": ask}]).choices[0].message.content

    for _ in range(2):
        assert re.fullmatch(regex, chat({"guided_regex": regex}))
    assert chat({"guided_choice": ["alpha", "beta", "gamma delta"]}) in ("alpha", "beta", "gamma delta")
    assert chat({"structured_outputs": {"choice": ["up", "down"]}}) in ("up", "down")
    for question in ("Write an arithmetic expression.", "What is 2 plus 3? Answer with an expression.",
                     "Give me a sum of three numbers.", ask):
        choice = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=80, extra_body={"guided_grammar": arithmetic},
            messages=[{"role": "user", "content": question + " " + ask}]).choices[0]
        assert choice.finish_reason == "stop", choice
        compile(choice.message.content, "<answer>", "eval")  # every answer parses as an expression
    completion = client.completions.create(model="smollm2", prompt=ask + "Code:", max_tokens=20, temperature=0,
                                           extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, completion.choices[0].text)


def test_bad_constraints_are_400s_naming_the_field(client):
    def refused(param_prefix: str, **extra):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="smollm2", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                                           extra_body=extra)
        assert info.value.body["message"].startswith(param_prefix), info.value.body

    refused("guided_regex: the regex", guided_regex="(unclosed")
    refused("guided_json: the JSON schema is not valid JSON", guided_json="{oops")
    refused("guided_choice:", guided_regex="a+", guided_choice=["a"])
    refused("response_format.json_schema.schema:", response_format={"type": "json_schema",
                                                                     "json_schema": {"name": "x"}})
    refused("logit_bias:", logit_bias={"not-a-token": 1})
    refused("logit_bias:", logit_bias={"5": 500})


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CONVERT = {"type": "object", "properties": {"amount": {"type": "number"},
                                            "currency": {"type": "string", "enum": ["EUR", "USD", "JPY"]}},
           "required": ["amount", "currency"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "convert_money", "description": "Convert money",
                                           "parameters": CONVERT}}]
QUESTIONS = [f"What is the weather in {c}?" for c in ("Paris", "Oslo", "Lima", "Cairo", "Tokyo")] + \
            [f"How much is {n} dollars in euros?" for n in (5, 12, 40, 99, 1000)]


def test_required_tool_calls_validate_and_the_follow_up_is_text(client):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def call(i: int):
        question = QUESTIONS[i % len(QUESTIONS)] + (" Please." if i >= len(QUESTIONS) else "")
        return question, client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=120, tools=TOOLS, tool_choice="required",
            # One call each: with parallel calls allowed, this 135M model,
            # greedy, repeats its call until max_tokens.
            parallel_tool_calls=False, messages=[{"role": "user", "content": question}]).choices[0]

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(call, range(20)))
    for question, choice in answers:
        assert choice.finish_reason == "tool_calls", (question, choice)
        assert choice.message.tool_calls, (question, choice)
        for tc in choice.message.tool_calls:
            jsonschema.validate(json.loads(tc.function.arguments), params[tc.function.name])
    question, choice = answers[0]
    follow_up = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=40, tools=TOOLS,
        messages=[{"role": "user", "content": question},
                  {"role": "assistant", "content": None,
                   "tool_calls": [tc.model_dump() for tc in choice.message.tool_calls]},
                  {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id,
                   "content": json.dumps({"temperature": 18, "sky": "clear"})}]).choices[0]
    assert not follow_up.message.tool_calls and follow_up.message.content, follow_up


def test_named_tool_call_streams_as_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=60, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "convert_money"}},
        messages=[{"role": "user", "content": "Convert 30 dollars to yen."}])
    calls, reason = {}, None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "convert_money"
    jsonschema.validate(json.loads(calls[0]["arguments"]), CONVERT)


def test_fifty_json_schemas_with_the_store_stopped(stack, client):
    stack.kill("kvstore")
    _check_all(client, [(s, i % 2 == 1) for i, s in enumerate(SCHEMAS)])
