"""What the HTTP gateway and the public gRPC API share: the served model, the
prompt (chat template applied and tokenized here, once), validation of
sampling parameters against the model's context, and the fan-out of n
choices into the dispatcher.

Errors are InvalidRequest with an OpenAI-style `param`; the APIs turn them
into HTTP 400/404 or gRPC INVALID_ARGUMENT/NOT_FOUND.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from tandem.services.router.dispatch import Delta, Dispatcher, merge_choices
from tandem.v1 import common_pb2

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class InvalidRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


@dataclass
class ServedModel:
    model_id: str  # the stable id clients see in /v1/models
    max_model_len: int
    tokenizer: Any
    aliases: set[str] = field(default_factory=set)  # other names accepted in requests


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    def __init__(self, model: ServedModel, dispatcher: Dispatcher) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.vocab_size = len(model.tokenizer)

    def check_model(self, name: Optional[str]) -> None:
        if name and name != self.model.model_id and name not in self.model.aliases:
            raise InvalidRequest(f"The model {name!r} does not exist; this server serves "
                                 f"{self.model.model_id!r} (see GET /v1/models).",
                                 param="model", status=404, code="model_not_found")

    # --- prompts ------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """messages: [{"role": ..., "content": str}] -> the templated prompt's token ids."""
        if not messages:
            raise InvalidRequest("messages: must contain at least one message", param="messages")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role: {m.get('role')!r} is not one of "
                                     f"{', '.join(CHAT_ROLES)}", param=f"messages[{i}].role")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content: must be a string",
                                     param=f"messages[{i}].content")
        try:
            text = self.model.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise on role orders they do not support
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}",
                                 param="messages") from None
        # The template already wrote the special tokens it wants.
        return self.tokenize(text, param="messages", add_special_tokens=False)

    def tokenize(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequest(f"{param}: must not be empty", param=param)
        ids = self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidRequest(f"{param}: tokenizes to no tokens", param=param)
        return list(ids)

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise InvalidRequest(f"{param}: must contain at least one token", param=param)
        for t in ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequest(f"{param}: token id {t} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", param=param)
        return list(ids)

    # --- sampling parameters ----------------------------------------------------------

    def finalize_params(self, prompt_len: int, params: common_pb2.SamplingParams) -> None:
        """Validate (the engine's own rules) and fit max_tokens to the context.
        Mutates params: an unset max_tokens becomes what the context leaves."""
        from tandem.engine.request import SamplingParamsError

        from tandem.services.common.engine_service import sampling_params_from_proto

        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens and the prompt has "
                f"{prompt_len}; shorten the prompt.", param="messages", code="context_length_exceeded")
        if not params.HasField("max_tokens"):
            params.max_tokens = limit - prompt_len
        elif params.max_tokens >= 1 and prompt_len + params.max_tokens > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
                f"and max_tokens asks for {params.max_tokens} more. Lower max_tokens to at most "
                f"{limit - prompt_len} or shorten the prompt.",
                param="max_tokens", code="context_length_exceeded")
        try:
            sampling_params_from_proto(params)
        except SamplingParamsError as exc:
            field_name = str(exc).split(":", 1)[0]
            raise InvalidRequest(str(exc), param=field_name) from None
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequest("stop_token_ids: outside the vocabulary", param="stop_token_ids")

    # --- generation ------------------------------------------------------------------

    def generate(self, request_id: str, prompt: list[int],
                 params: common_pb2.SamplingParams) -> AsyncIterator[tuple[int, Delta]]:
        """n choices as n independent pipelines (request ids {id}-{i}, seeds seed+i),
        interleaved as (choice index, delta)."""
        n = params.n or 1
        streams = []
        for i in range(n):
            p = common_pb2.SamplingParams()
            p.CopyFrom(params)
            p.n = 1
            if params.HasField("seed"):
                p.seed = params.seed + i
            streams.append(self.dispatcher.generate(f"{request_id}-{i}", prompt, p))
        return merge_choices(streams)
