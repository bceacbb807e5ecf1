"""Tool calling in the router, without a model: the grammar a forced call
gets, the parsers per model family, the prompt for templates without tools,
and the streamed shape (content until a call's marker, then tool_calls)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.services.router.dispatch import Delta
from tandem.services.router.openai_protocol import ChatCompletionRequest, LogprobFormatter
from tandem.services.router.tool_answers import ToolChatShape
from tandem.services.router.tool_calls import (HermesToolParser, Llama3JsonToolParser, forced_calls,
                                               forced_constraint, hermes_messages, parser_for)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city"]}
BODY = ChatCompletionRequest.model_validate({
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time"}}]})


def _delta(text: str, finish: str | None = None) -> Delta:
    return Delta(token_ids=[], text=text, logprobs=[], finish_reason=finish, num_prompt_tokens=0,
                 num_output_tokens=0, num_cached_tokens=0)


def test_required_is_an_array_of_calls_to_known_tools():
    so = forced_constraint(BODY.tools, "required", parallel=False)
    answer = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(answer, so.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "launch", "parameters": {}}], so.json)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate(answer * 2, so.json)
    calls = forced_calls(json.dumps(answer), "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_a_named_function_constrains_to_its_parameters():
    named = ChatCompletionRequest.model_validate({**BODY.model_dump(exclude_none=True),
                                                  "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}})
    assert forced_constraint(named.tools, named.tool_choice, True).json == WEATHER
    bad = named.model_copy(update={"tool_choice": named.tool_choice.model_copy(
        update={"function": named.tool_choice.function.model_copy(update={"name": "nope"})})})
    with pytest.raises(ValueError, match="^tool_choice: names the function 'nope'"):
        forced_constraint(bad.tools, bad.tool_choice, True)


def test_hermes_parser():
    names = {"get_weather", "get_time"}
    parser = HermesToolParser()
    content, calls = parser.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo"}}\n</tool_call>\n<tool_call>{"name": "get_time", '
                                  '"arguments": {}}</tool_call>', names)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                  ("get_time", {})]
    # An unterminated last block (the model stopped at EOS) still counts.
    assert parser.parse('<tool_call>{"name": "get_time", "arguments": {}}', names)[1]
    # Unknown tools and broken JSON stay text.
    for text in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
                 "no calls here"):
        assert parser.parse(text, names) == (text, [])


def test_llama3_json_parser():
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                                  '{"name": "get_time", "parameters": {}}', {"get_time"})
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"tz": "UTC"}, {}]
    assert parser.parse("It is noon.", {"get_time"}) == ("It is noon.", [])
    assert isinstance(parser_for("{{ '<|python_tag|>' }}"), Llama3JsonToolParser)
    assert isinstance(parser_for("{{ messages }}"), HermesToolParser)


def test_templates_without_tools_get_them_in_the_system_message():
    tools = [t.model_dump(exclude_none=True) for t in BODY.tools]
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    out = hermes_messages(history, tools)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                                                      '"arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    assert all(isinstance(m["content"], str) for m in out)


class _NoTokenizer:
    def decode(self, ids):
        return ""


def test_streamed_auto_answer_sends_content_then_calls():
    shape = ToolChatShape(LogprobFormatter(_NoTokenizer()), None, parser=HermesToolParser(),
                          tool_choice="auto", tool_names={"get_time"})
    pieces = ["Sure", ". <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    chunks = [shape.chunk_choice(0, _delta(p), 0) for p in pieces]
    last = shape.chunk_choice(0, _delta("", "stop"), 0)
    sent = "".join((c or {}).get("delta", {}).get("content", "") for c in chunks)
    assert sent == "Sure. "  # "<tool" was held back: it might begin a call
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_streamed_text_that_only_looked_like_a_call_is_sent_whole():
    shape = ToolChatShape(LogprobFormatter(_NoTokenizer()), None, parser=HermesToolParser(),
                          tool_choice="auto", tool_names={"get_time"})
    first = shape.chunk_choice(0, _delta("a <tool"), 0)
    last = shape.chunk_choice(0, _delta("box> b", "stop"), 0)
    assert first["delta"]["content"] + last["delta"]["content"] == "a <toolbox> b"
    assert last["finish_reason"] == "stop"


def test_a_forced_call_cut_by_max_tokens_comes_back_as_content():
    shape = ToolChatShape(LogprobFormatter(_NoTokenizer()), None, parser=None, tool_choice="required",
                          tool_names={"get_time"})
    last = shape.chunk_choice(0, _delta('[{"name": "get_ti', "length"), 0)
    assert last["finish_reason"] == "length" and last["delta"] == {"content": '[{"name": "get_ti'}


def test_without_parallel_calls_a_free_answer_keeps_its_first_call():
    text = ('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    for parallel, expected in ((True, 2), (False, 1)):
        shape = ToolChatShape(LogprobFormatter(_NoTokenizer()), None, parser=HermesToolParser(),
                              tool_choice="auto", tool_names={"get_time"}, parallel=parallel)
        last = shape.chunk_choice(0, _delta(text, "stop"), 0)
        assert len(last["delta"]["tool_calls"]) == expected
