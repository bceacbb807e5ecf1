"""What the gateway does with every request field it knows: OpenAI's chat
and completions fields and the vLLM extras clients commonly send. One entry
per field, so that whoever implements a field turns its one entry into
HONOURED (and declares it on the request model in openai_protocol.py).

A field that is neither declared on the request model nor listed here is
refused as unknown: nothing a client sends is silently dropped. A field
sent as null counts as not sent (clients write unset options as null).

    HONOURED  the gateway does what it asks
    ACCEPTED  it asks for nothing this server could do otherwise (an id for
              the provider's abuse monitoring, a cache hint for a cache that
              is automatic): taking it is true
    REFUSED   400 naming it, except for the values that ask for the default
              (`allows`), e.g. store: false
    NOT_YET   as REFUSED, "not supported yet": someone is implementing it
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

HONOURED, ACCEPTED, REFUSED, NOT_YET = "honoured", "accepted", "refused", "not yet"
CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "chat", "completions", "tokenize", "detokenize"
BOTH = frozenset({CHAT, COMPLETIONS})
CHAT_TEMPLATE = frozenset({CHAT, TOKENIZE})  # the fields that render a chat


def _never(value: Any) -> bool:
    return False


@dataclass(frozen=True)
class FieldRule:
    decision: str  # HONOURED, ACCEPTED, REFUSED or NOT_YET
    why: str  # what it means here; shown in the 400 and in docs/api.md
    # REFUSED / NOT_YET: values that ask for nothing beyond the default, taken as sent.
    allows: Callable[[Any], bool] = _never
    on: frozenset = BOTH  # the endpoints whose request model declares it (HONOURED / ACCEPTED)


def _rule(decision: str, why: str, allows: Callable[[Any], bool] = _never, on=BOTH) -> FieldRule:
    return FieldRule(decision, why, allows, frozenset({on}) if isinstance(on, str) else frozenset(on))


def honoured(why: str, on=BOTH) -> FieldRule:
    return _rule(HONOURED, why, on=on)


def accepted(why: str, on=BOTH) -> FieldRule:
    return _rule(ACCEPTED, why, on=on)


def refused(why: str, allows: Callable[[Any], bool] = _never) -> FieldRule:
    return _rule(REFUSED, why, allows)


def not_yet(why: str, allows: Callable[[Any], bool] = _never) -> FieldRule:
    return _rule(NOT_YET, why, allows)


def _is(*values: Any) -> Callable[[Any], bool]:
    # `type(v) is type(x)`: JSON's false must not pass for 0, nor 1 for true.
    return lambda v: any(type(v) is type(x) and v == x for x in values)


# Keys: a top-level field, or a nested one with [] for a list index
# ("messages[].tool_calls"). Nested ones are reported with their real index.
FIELDS: dict[str, FieldRule] = {
    # --- OpenAI, both endpoints ---------------------------------------------------------
    "model": honoured("any name of --served-model-name (default: the engines' model)",
                      on=BOTH | {TOKENIZE, DETOKENIZE}),
    "max_tokens": honoured("output tokens at most; unset: what the context leaves (chat), 16 (completions)"),
    "temperature": honoured("sampling temperature; 0 is greedy"),
    "top_p": honoured("nucleus sampling"),
    "n": honoured("choices per prompt, each its own request in the tiers"),
    "stream": honoured("server-sent events"),
    "stream_options": honoured("include_usage: a last chunk with the usage"),
    "stream_options.include_obfuscation": refused(
        "this server adds no obfuscation padding to stream chunks", allows=_is(False)),
    "stop": honoured("stop strings (up to 16)"),
    "seed": honoured("seeds the sampler: each choice reproducible on its own"),
    "presence_penalty": honoured("OpenAI's presence penalty"),
    "frequency_penalty": honoured("OpenAI's frequency penalty"),
    "logprobs": honoured("chat: true/false; completions: top alternatives per token (0-20)"),
    "user": accepted("an end-user id for OpenAI's abuse monitoring; kept nowhere here"),
    "logit_bias": honoured("token id -> bias (-100..100) added to its logit before sampling"),
    # --- OpenAI, chat -------------------------------------------------------------------
    "messages": honoured("rendered with the model's chat template", on=CHAT_TEMPLATE),
    "messages[].name": honoured("passed to the chat template (which may ignore it)", on=CHAT_TEMPLATE),
    "messages[].tool_calls": honoured("an assistant's earlier tool calls, through the chat template "
                                      "(or as <tool_call> blocks: docs/structured_outputs.md)", on=CHAT_TEMPLATE),
    "messages[].tool_call_id": honoured("the call a tool message answers", on=CHAT_TEMPLATE),
    "max_completion_tokens": honoured("as max_tokens; wins over it when both are set", on=CHAT),
    "top_logprobs": honoured("alternatives per token (0-20), with logprobs: true", on=CHAT),
    "safety_identifier": accepted("an end-user id for OpenAI's abuse monitoring; kept nowhere here",
                                  on=CHAT),
    "prompt_cache_key": accepted("a routing hint for OpenAI's prompt cache; prefix caching here is "
                                 "automatic and shared by every request", on=CHAT),
    "prompt_cache_retention": refused("prefixes stay cached only while memory allows; no retention "
                                      "is promised", allows=_is("in_memory")),
    "prompt_cache_options": refused("prefixes stay cached only while memory allows; no cache "
                                    "breakpoints or lifetimes", allows=lambda v: v == {}),
    "store": refused("this server stores no completions", allows=_is(False)),
    "metadata": refused("tags for stored completions; this server stores none",
                        allows=lambda v: v == {}),
    "service_tier": refused("one tier only: the default", allows=_is("auto", "default")),
    "modalities": refused("text output only", allows=lambda v: v == ["text"]),
    "audio": refused("text output only"),
    "prediction": refused("no predicted outputs (speculative decoding from the request)"),
    "reasoning_effort": refused("not a reasoning model's setting here"),
    "verbosity": refused("no verbosity control"),
    "web_search_options": refused("no web search"),
    "moderation": refused("no moderation"),
    "response_format": honoured("text, json_object or json_schema: the answer follows the grammar"),
    "tools": honoured("functions the model may call", on=CHAT),
    "tool_choice": honoured("none, auto, required or a named function (required and named are "
                            "enforced by a grammar)", on=CHAT),
    "parallel_tool_calls": honoured("false: at most one call per answer (enforced where the call is "
                                    "forced)", on=CHAT),
    "functions": refused("the deprecated form of tools; send tools", allows=lambda v: v == []),
    "function_call": refused("the deprecated form of tool_choice; send tool_choice", allows=_is("none")),
    # --- OpenAI, completions ------------------------------------------------------------
    "prompt": honoured("text, token ids, or a list of either (one answer per prompt); /tokenize: "
                       "text", on={COMPLETIONS, TOKENIZE}),
    "echo": refused("the answer does not repeat the prompt (chat: vLLM's echo neither)",
                    allows=_is(False)),
    "suffix": refused("no insertion (fill-in-the-middle)", allows=_is("")),
    "best_of": honoured("with use_beam_search: the beam width; without it only n (sampling more "
                        "candidates than returned is not offered)"),
    # --- vLLM's extras ------------------------------------------------------------------
    "top_k": honoured("top-k sampling; -1 or 0: off"),
    "min_p": honoured("min-p sampling"),
    "repetition_penalty": honoured("vLLM's repetition penalty"),
    "ignore_eos": honoured("keep generating past the end-of-sequence token"),
    "min_tokens": honoured("no stop before this many output tokens"),
    "stop_token_ids": honoured("token ids that stop the choice"),
    "include_stop_str_in_output": honoured("keep the matched stop string in the text"),
    "add_special_tokens": honoured("tokenize the prompt with the tokenizer's special tokens (BOS); "
                                   "default: true for completions, false for chat (the template "
                                   "writes them)", on=BOTH | {TOKENIZE}),
    "truncate_prompt_tokens": honoured("keep only the prompt's last k tokens"),
    "request_id": honoured("the answer's id is <chatcmpl|cmpl>-<request_id> (engines keep their own "
                           "unique ids)"),
    "add_generation_prompt": honoured("end the templated prompt with the assistant's turn",
                                      on=CHAT_TEMPLATE),
    "continue_final_message": honoured("continue the last (assistant) message instead of starting "
                                       "a new turn", on=CHAT_TEMPLATE),
    "chat_template_kwargs": honoured("extra variables for the chat template", on=CHAT_TEMPLATE),
    "return_token_strs": honoured("/tokenize: the tokens' strings too (token_strs)", on=TOKENIZE),
    "tokens": honoured("/detokenize: the token ids to turn into text", on=DETOKENIZE),
    "skip_special_tokens": refused("special tokens are always left out of the text",
                                   allows=_is(True)),
    "spaces_between_special_tokens": accepted("special tokens are always left out of the text, so "
                                              "there are none to space"),
    "chat_template": refused("the model's own chat template only"),
    "prompt_logprobs": refused("no log-probabilities of prompt tokens"),
    "priority": refused("no priority scheduling: requests are served first come, first served",
                        allows=_is(0)),
    "bad_words": refused("no banned words"),
    "allowed_token_ids": refused("no restriction of the vocabulary"),
    "logits_processors": refused("no custom logits processors"),
    "return_tokens_as_token_ids": refused("logprobs name tokens by their text"),
    "documents": refused("no documents for the chat template"),
    "cache_salt": refused("the prefix cache is shared by every request; no salt separates them"),
    "use_beam_search": honoured("beam search: the n best of best_of (or n) beams, as HF's generate"),
    "length_penalty": honoured("beam search: finished beams score sum_logprobs / length**length_penalty"),
    "early_stopping": honoured("beam search: true, false or \"never\" (HF's stopping rules)"),
    "guided_json": honoured("the answer follows this JSON schema"),
    "guided_regex": honoured("the answer matches this regex"),
    "guided_choice": honoured("the answer is one of these strings"),
    "guided_grammar": honoured("the answer follows this EBNF grammar"),
    "guided_decoding_backend": refused("one grammar backend: xgrammar", allows=_is("xgrammar", "auto")),
    "structured_outputs": honoured("vLLM's form of the constraints: json, json_object, regex, choice "
                                   "or grammar"),
}


@dataclass(frozen=True)
class Refusal:
    message: str
    param: str


def _table_key(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def check_field(path: str, value: Any) -> Optional[Refusal]:
    """A field the request model does not declare, at `path` (messages[2].tool_calls):
    None if it may pass (null, or a value its rule allows), else why not."""
    if value is None:
        return None
    rule = FIELDS.get(_table_key(path))
    if rule is None:
        return Refusal(f"{path}: unknown field; this server does not take it (see docs/api.md for "
                       "the fields it does)", path)
    if rule.decision in (HONOURED, ACCEPTED):
        # Declared on the other endpoint's model only (prompt on chat, messages on completions).
        return Refusal(f"{path}: not a field of this endpoint", path)
    if rule.allows(value):
        return None
    yet = " yet" if rule.decision == NOT_YET else ""
    return Refusal(f"{path}: not supported{yet} ({rule.why}); leave it out", path)
