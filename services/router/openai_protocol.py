"""The OpenAI request schema the gateway accepts (plus vLLM's sampling extras)
and the response objects it writes. Parsing is strict about types, so a
wrong type is a 400 naming the field, never a silent coercion."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.v1 import common_pb2

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send more than we use); known ones
    # must have the right type.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> Optional[str]:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class StreamOptions(_Strict):
    include_usage: bool = False


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
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[Int32] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    stop_token_ids: Optional[list[Int32]] = None
    include_stop_str_in_output: bool = False
    # vLLM's beam search extras (services/router/beam.py): the beam width is
    # best_of or n; best_of without use_beam_search must equal n.
    use_beam_search: bool = False
    best_of: Optional[Annotated[int, Field(ge=1, le=2**31 - 1)]] = None
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> common_pb2.SamplingParams:
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
        return p


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int32] = None
    logprobs: bool = False
    top_logprobs: Optional[Int32] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[Int32], list[str], list[list[Int32]]]
    max_tokens: Optional[Int32] = 16  # the OpenAI default for completions
    logprobs: Optional[Int32] = None
    echo: bool = False
    suffix: Optional[str] = None


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
