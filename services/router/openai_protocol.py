"""The OpenAI request schema the gateway accepts (plus vLLM's sampling extras)
and the response objects it writes. Parsing is strict about types, so a
wrong type is a 400 naming the field, never a silent coercion."""
from __future__ import annotations

import time
from typing import Annotated, Any, Iterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.engine.structured_outputs import StructuredOutputs, StructuredOutputsError
from tandem.v1 import common_pb2

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Strict(BaseModel):
    # Fields the model does not declare are kept (model_extra), for
    # undeclared_fields() to show to the field table (request_fields.py),
    # which refuses what it does not allow: none is silently dropped. Declared
    # ones must have the right type.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """An assistant's earlier tool call, in the history."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # role "assistant"
    tool_call_id: Optional[str] = None  # role "tool": the call this answers

    def text(self) -> Optional[str]:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content

    def for_template(self) -> dict:
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:  # templates that know names use it; the others ignore it
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute in pydantic: read it through an alias.
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsFields(_Strict):
    """vLLM's `structured_outputs` object: exactly one constraint."""
    json_: Union[str, dict[str, Any], None] = Field(default=None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


class _SamplingFields(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[Int32] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Annotated[int, Field(ge=1, le=2**31 - 1)] = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[Int64] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None  # accepted, unused (request_fields.py)
    # vLLM's extras
    top_k: Optional[Int32] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    stop_token_ids: Optional[list[Int32]] = None
    include_stop_str_in_output: bool = False
    # OpenAI: token id (as a JSON key) -> bias in [-100, 100]
    logit_bias: Optional[dict[str, float]] = None
    # Structured outputs: OpenAI's response_format, and vLLM's extras
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsFields] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=1, le=2**31 - 1)]] = None
    request_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    spaces_between_special_tokens: Optional[bool] = None  # accepted: special tokens are never shown
    # vLLM's beam search extras (services/router/beam.py): the beam width is
    # best_of or n; best_of without use_beam_search must equal n.
    use_beam_search: bool = False
    best_of: Optional[Annotated[int, Field(ge=1, le=2**31 - 1)]] = None
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    def structured_outputs_spec(self) -> Optional[StructuredOutputs]:
        """The one output constraint the request asks for, or None; raises
        StructuredOutputsError naming the field when it is malformed or when
        more than one field asks for a constraint."""
        given: list[StructuredOutputs] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(StructuredOutputs(json_object=True, field_name="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise StructuredOutputsError("response_format.json_schema.schema: required when "
                                             "response_format.type is json_schema")
            given.append(StructuredOutputs(json=rf.json_schema.schema_,
                                           field_name="response_format.json_schema.schema"))
        so = self.structured_outputs
        if so is not None:
            set_ = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
                                      ("choice", so.choice), ("grammar", so.grammar)) if v not in (None, False)}
            if len(set_) != 1:
                raise StructuredOutputsError("structured_outputs: give exactly one of json, json_object, "
                                             f"regex, choice, grammar; got {', '.join(set_) or 'none'}")
            (kind, value), = set_.items()
            given.append(StructuredOutputs(**{kind: value}, field_name=f"structured_outputs.{kind}"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append(StructuredOutputs(**{kind: value}, field_name=name))
        if len(given) > 1:
            names = ", ".join(g.field_name.split(".")[0] for g in given)
            raise StructuredOutputsError(f"{given[1].field_name.split('.')[0]}: one output constraint "
                                         f"per request; this one sets {names}")
        return given[0] if given else None

    def logit_bias_ids(self) -> dict[int, float]:
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise StructuredOutputsError(f"logit_bias: keys must be token ids, got {key!r}") from None
            out[token] = value
        return out

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        structured: Optional[StructuredOutputs] = None) -> common_pb2.SamplingParams:
        """structured: the constraint structured_outputs_spec() gave (the
        prompt workers compute and check it once)."""
        p = common_pb2.SamplingParams(
            n=self.n, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, min_tokens=self.min_tokens)
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(p, name, value)
        if max_tokens is not None:
            p.max_tokens = max_tokens
        if logprobs is not None:
            p.logprobs = logprobs
        if self.logit_bias:
            p.logit_bias.update(self.logit_bias_ids())
        if structured is not None:
            from tandem.services.common.proto_convert import structured_outputs_to_proto

            p.structured_outputs.CopyFrom(structured_outputs_to_proto(structured))
        return p


class FunctionDef(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; none: no arguments
    strict: Optional[bool] = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    tools: Optional[list[ToolDef]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Optional[Int32] = None
    logprobs: bool = False
    top_logprobs: Optional[Int32] = None
    safety_identifier: Optional[str] = None  # accepted, unused
    prompt_cache_key: Optional[str] = None  # accepted, unused: prefix caching is automatic
    # vLLM's: how the chat template renders the messages.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False  # the template writes the special tokens it wants


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Int32], list[str], list[list[Int32]]]
    max_tokens: Optional[Int32] = 16  # the OpenAI default for completions
    logprobs: Optional[Int32] = None
    add_special_tokens: bool = True


def undeclared_fields(model: BaseModel, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every field the client sent that `model` and the
    models in it do not declare, e.g. ("messages[2].tool_calls", [...])."""
    for name, value in (model.model_extra or {}).items():
        yield f"{path}{name}", value
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from undeclared_fields(value, f"{path}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for i, item in enumerate(value):
                yield from undeclared_fields(item, f"{path}{name}[{i}].")


def validation_message(exc: ValidationError) -> tuple[str, Optional[str]]:
    """A parse error as (message naming the field, the field's path or None)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        return f"The body is not valid JSON: {first.get('msg')}", None
    # Union members add their type name to loc; keep only the field path.
    path = ".".join(p for p in loc if not p[0].isupper() and "[" not in p and p not in
                    ("str", "list", "int", "bool", "function-after"))
    return f"{path or 'body'}: {first.get('msg')}", path or None


# --- responses ----------------------------------------------------------------------

def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Optional[str | int] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def now() -> int:
    return int(time.time())


class LogprobFormatter:
    """Token ids -> the two OpenAI logprob shapes (chat and legacy completions)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text

    def chat(self, logprobs: list[common_pb2.TokenLogprob]) -> list[dict]:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        out = []
        for lp in logprobs:
            item = entry(lp.token_id, lp.logprob)
            top = sorted(lp.top.items(), key=lambda kv: -kv[1])
            item["top_logprobs"] = [entry(t, v) for t, v in top]
            out.append(item)
        return out

    def completion(self, logprobs: list[common_pb2.TokenLogprob], text_offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self.token(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            tops.append({self.token(t): v for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
