"""Every request field a client may send the gateway, with a value that is not
its default: the keys of the installed `openai` package's request TypedDicts
(chat and completions), and the vLLM extras of tandem's field table. The
gateway must honour each or refuse it with a 400 naming it; a key with no
example here fails the tests that use this module, so a new field of a newer
`openai` is decided (services/router/request_fields.py) and tested, never
silently dropped."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Optional

from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from tandem.services.router.request_fields import (ACCEPTED, CHAT, COMPLETIONS, FIELDS, HONOURED,
                                                   FieldRule)


def typed_dict_keys(cls: type) -> list[str]:
    """Every key of a TypedDict, its bases' included."""
    keys: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        keys.update(dict.fromkeys(getattr(klass, "__annotations__", {})))
    keys.update(dict.fromkeys(typing.get_type_hints(cls)))
    return list(keys)


OPENAI_KEYS = {CHAT: typed_dict_keys(chat_params.CompletionCreateParamsBase),
               COMPLETIONS: typed_dict_keys(completion_params.CompletionCreateParamsBase)}
OPENAI_ANY = set(OPENAI_KEYS[CHAT]) | set(OPENAI_KEYS[COMPLETIONS])

FUNCTION = {"name": "f", "parameters": {"type": "object", "properties": {}}}


@dataclass(frozen=True)
class Example:
    fields: dict  # sent on top of the base request
    param: Optional[str] = None  # the param a refusal names, when not the key itself
    # Checks of an answer that honours it: (answer as a dict) -> bool.
    check: Optional[typing.Callable[[dict], bool]] = None


# Shared by both endpoints unless CHAT_ONLY / COMPLETION_ONLY say otherwise.
EXAMPLES: dict[str, Example] = {
    "model": Example({"model": "smol"}, check=lambda a: a["model"] == "tandem-smol"),
    "max_tokens": Example({"max_tokens": 3}, check=lambda a: a["usage"]["completion_tokens"] <= 3),
    "temperature": Example({"temperature": 0.7}),
    "top_p": Example({"top_p": 0.9}),
    "n": Example({"n": 2}, check=lambda a: len(a["choices"]) == 2),
    "stream": Example({"stream": True}),
    "stream_options": Example({"stream": True, "stream_options": {"include_usage": True}}),
    "stream_options.include_obfuscation": Example(
        {"stream": True, "stream_options": {"include_obfuscation": True}}),
    "stop": Example({"stop": ["\n", "."]}),
    "seed": Example({"seed": 7}),
    "presence_penalty": Example({"presence_penalty": 0.5}),
    "frequency_penalty": Example({"frequency_penalty": 0.5}),
    "user": Example({"user": "user-1"}),
    "logit_bias": Example({"logit_bias": {"42": 5}}),
    # chat
    "messages": Example({"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}]}),
    "messages[].name": Example({"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}),
    "messages[].tool_calls": Example(
        {"messages": [{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                      {"role": "user", "content": "Go on"}]}, param="messages[1].tool_calls"),
    "messages[].tool_call_id": Example(
        {"messages": [{"role": "user", "content": "Hi", "tool_call_id": "c1"}]},
        param="messages[0].tool_call_id"),
    "max_completion_tokens": Example({"max_completion_tokens": 3},
                                     check=lambda a: a["usage"]["completion_tokens"] <= 3),
    "logprobs": Example({"logprobs": 2}),  # completions; chat's is in CHAT_ONLY
    "top_logprobs": Example({"logprobs": True, "top_logprobs": 2},
                            check=lambda a: len(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "safety_identifier": Example({"safety_identifier": "user-1"}),
    "prompt_cache_key": Example({"prompt_cache_key": "conversation-1"}),
    "prompt_cache_retention": Example({"prompt_cache_retention": "24h"}),
    "prompt_cache_options": Example({"prompt_cache_options": {"ttl": "1h"}}),
    "store": Example({"store": True}),
    "metadata": Example({"metadata": {"k": "v"}}),
    "service_tier": Example({"service_tier": "flex"}),
    "modalities": Example({"modalities": ["text", "audio"]}),
    "audio": Example({"audio": {"voice": "alloy", "format": "wav"}}),
    "prediction": Example({"prediction": {"type": "content", "content": "Hello"}}),
    "reasoning_effort": Example({"reasoning_effort": "low"}),
    "verbosity": Example({"verbosity": "low"}),
    "web_search_options": Example({"web_search_options": {"search_context_size": "low"}}),
    "moderation": Example({"moderation": {"model": "omni-moderation-latest"}}),
    "response_format": Example({"response_format": {"type": "json_object"}}),
    "tools": Example({"tools": [{"type": "function", "function": FUNCTION}]}),
    "tool_choice": Example({"tools": [{"type": "function", "function": FUNCTION}], "tool_choice": "required"}),
    "parallel_tool_calls": Example({"tools": [{"type": "function", "function": FUNCTION}],
                                    "parallel_tool_calls": False}),
    "functions": Example({"functions": [FUNCTION]}),
    "function_call": Example({"function_call": "auto"}),
    # completions
    "prompt": Example({"prompt": [[1, 9690, 198], [1, 19556]]}, check=lambda a: len(a["choices"]) == 2),
    "echo": Example({"echo": True}),
    "suffix": Example({"suffix": " the end."}),
    "best_of": Example({"use_beam_search": True, "best_of": 3}),
    # vLLM's
    "top_k": Example({"top_k": 5}),
    "min_p": Example({"min_p": 0.1}),
    "repetition_penalty": Example({"repetition_penalty": 1.2}),
    "ignore_eos": Example({"ignore_eos": True}),
    "min_tokens": Example({"min_tokens": 2, "max_tokens": 3},
                          check=lambda a: a["usage"]["completion_tokens"] >= 2),
    "stop_token_ids": Example({"stop_token_ids": [2]}),
    "include_stop_str_in_output": Example({"include_stop_str_in_output": True}),
    "add_special_tokens": Example({"add_special_tokens": True}),  # chat; completions' in COMPLETION_ONLY
    "truncate_prompt_tokens": Example({"truncate_prompt_tokens": 3},
                                      check=lambda a: a["usage"]["prompt_tokens"] == 3),
    "request_id": Example({"request_id": "my-request-7"},
                          check=lambda a: a["id"].endswith("-my-request-7")),
    "add_generation_prompt": Example({"add_generation_prompt": False}),
    "continue_final_message": Example(
        {"add_generation_prompt": False, "continue_final_message": True,
         "messages": [{"role": "user", "content": "Count to five."},
                      {"role": "assistant", "content": "One, two,"}]}),
    "chat_template_kwargs": Example({"chat_template_kwargs": {"enable_thinking": False}}),
    "skip_special_tokens": Example({"skip_special_tokens": False}),
    "spaces_between_special_tokens": Example({"spaces_between_special_tokens": False}),
    "chat_template": Example({"chat_template": "{{ messages[0]['content'] }}"}),
    "prompt_logprobs": Example({"prompt_logprobs": 1}),
    "priority": Example({"priority": 5}),
    "bad_words": Example({"bad_words": ["no"]}),
    "allowed_token_ids": Example({"allowed_token_ids": [1, 2, 3]}),
    "logits_processors": Example({"logits_processors": ["my.module:Processor"]}),
    "return_tokens_as_token_ids": Example({"return_tokens_as_token_ids": True}),
    "documents": Example({"documents": [{"title": "t", "text": "x"}]}),
    "cache_salt": Example({"cache_salt": "tenant-1"}),
    "use_beam_search": Example({"use_beam_search": True}),
    "length_penalty": Example({"use_beam_search": True, "length_penalty": 0.5}),
    "early_stopping": Example({"use_beam_search": True, "early_stopping": True}),
    "guided_json": Example({"guided_json": {"type": "object"}}),
    "guided_regex": Example({"guided_regex": "a+"}),
    "guided_choice": Example({"guided_choice": ["yes", "no"]}),
    "guided_grammar": Example({"guided_grammar": "root ::= \"a\""}),
    "guided_decoding_backend": Example({"guided_decoding_backend": "outlines"}),
    "structured_outputs": Example({"structured_outputs": {"json": {"type": "object"}}}),
}
CHAT_ONLY = {"logprobs": Example({"logprobs": True},
                                 check=lambda a: a["choices"][0]["logprobs"]["content"] is not None)}
COMPLETION_ONLY = {"add_special_tokens": Example({"add_special_tokens": False})}


@dataclass(frozen=True)
class Case:
    endpoint: str  # CHAT or COMPLETIONS
    key: str  # a key of FIELDS or of openai's TypedDicts
    example: Optional[Example]  # None: nobody decided what to send (a new field)
    rule: Optional[FieldRule]  # None: the table does not know it

    @property
    def honoured(self) -> bool:
        return (self.rule is not None and self.rule.decision in (HONOURED, ACCEPTED)
                and self.endpoint in self.rule.on)

    @property
    def id(self) -> str:
        return f"{self.endpoint}:{self.key}"


def _vllm_keys(endpoint: str) -> list[str]:
    """Table keys beyond openai's that a client of `endpoint` may send."""
    keys = []
    for key, rule in FIELDS.items():
        if key in OPENAI_ANY:
            continue
        if rule.decision in (HONOURED, ACCEPTED):
            if endpoint in rule.on:
                keys.append(key)
        elif not key.startswith("messages[") or endpoint == CHAT:  # completions have no messages
            keys.append(key)
    return keys


def cases() -> list[Case]:
    out = []
    for endpoint, only in ((CHAT, CHAT_ONLY), (COMPLETIONS, COMPLETION_ONLY)):
        for key in dict.fromkeys([*OPENAI_KEYS[endpoint], *_vllm_keys(endpoint)]):
            out.append(Case(endpoint, key, only.get(key, EXAMPLES.get(key)), FIELDS.get(key)))
    return out


def base_request(endpoint: str) -> dict:
    if endpoint == CHAT:
        return {"model": "tandem-smol", "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 2}
    return {"model": "tandem-smol", "prompt": "The sky is", "max_tokens": 2}


@dataclass
class Sent:
    """What one case sends, split as the openai client takes it."""

    kwargs: dict = field(default_factory=dict)  # its typed parameters
    extra_body: dict = field(default_factory=dict)  # the rest (vLLM's)


def request_for(case: Case) -> Sent:
    body = {**base_request(case.endpoint), **case.example.fields}
    sent = Sent()
    for key, value in body.items():
        (sent.kwargs if key in OPENAI_KEYS[case.endpoint] or key == "stream" else sent.extra_body)[key] = value
    return sent
