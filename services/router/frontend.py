"""What the HTTP gateway and the public gRPC API share: the served model, the
prompt (chat template applied and tokenized once, in the PromptPool's worker
processes, off the event loop), validation of sampling parameters against the
model's context, and the fan-out of n choices into the dispatcher.

Errors are InvalidRequest with an OpenAI-style `param`; the APIs turn them
into HTTP 400/404 or gRPC INVALID_ARGUMENT/NOT_FOUND.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from tandem.engine.request import choice_seed
from tandem.services.router.dispatch import Delta, Dispatcher, merge_choices
from tandem.services.router.prompts import InvalidRequest, PromptPool
from tandem.v1 import common_pb2

__all__ = ["Frontend", "InvalidRequest", "ServedModel", "new_request_id"]


@dataclass
class ServedModel:
    model_id: str  # the stable id clients see in /v1/models
    max_model_len: int
    tokenizer: Any
    aliases: set[str] = field(default_factory=set)  # other names accepted in requests


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    def __init__(self, model: ServedModel, dispatcher: Dispatcher, prompts: PromptPool) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.prompts = prompts
        self.vocab_size = len(model.tokenizer)

    def check_model(self, name: Optional[str]) -> None:
        if name and name != self.model.model_id and name not in self.model.aliases:
            raise InvalidRequest(f"The model {name!r} does not exist; this server serves "
                                 f"{self.model.model_id!r} (see GET /v1/models).",
                                 param="model", status=404, code="model_not_found")

    # --- sampling parameters ----------------------------------------------------------

    def finalize_params(self, prompt_len: int, params: common_pb2.SamplingParams) -> None:
        """Validate (the engine's own rules) and fit max_tokens to the context.
        Mutates params: an unset max_tokens becomes what the context leaves.
        The prompt is shorter than the context (the PromptPool checked it)."""
        from tandem.engine.request import SamplingParamsError

        from tandem.services.common.proto_convert import sampling_params_from_proto

        limit = self.model.max_model_len
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
        """n choices as n independent pipelines (request ids {id}-{i}), interleaved
        as (choice index, delta). Choice i gets the seed seed+i wrapped around
        within int64, so that it fits the wire: seed 2**63-1 gives choice 1 the
        seed -2**63."""
        n = params.n or 1
        streams = []
        for i in range(n):
            p = common_pb2.SamplingParams()
            p.CopyFrom(params)
            p.n = 1
            if params.HasField("seed"):
                p.seed = choice_seed(params.seed, i)
            streams.append(self.dispatcher.generate(f"{request_id}-{i}", prompt, p))
        return merge_choices(streams)
