"""What the HTTP gateway and the public gRPC API share: the served model as
the engines report it (engine_reports.py), the prompt (chat template applied
and tokenized once, in the PromptPool's worker processes, off the event
loop), validation of sampling parameters against the engines' context, and
the fan-out of n choices into the dispatcher.

Errors are InvalidRequest with an OpenAI-style `param`; the APIs turn them
into HTTP 400/404 or gRPC INVALID_ARGUMENT/NOT_FOUND.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import grpc

from tandem.engine.request import SamplingParams, SamplingParamsError
from tandem.services.router.dispatch import Delta, DispatchError, Dispatcher, merge_choices
from tandem.services.router.engine_reports import EngineReports, ModelView
from tandem.services.router.prompter import InvalidRequest
from tandem.services.router.prompts import PromptPool
from tandem.v1 import common_pb2

__all__ = ["Frontend", "InvalidRequest", "ModelView", "ServedModel", "new_request_id"]


@dataclass
class ServedModel:
    """The router's own side of the model: its tokenizer and the names it
    accepts. What the engines serve (id, context) comes from their reports."""

    model_id: str  # what the router's --model names (metrics label; the id while no engine reports)
    # A context limit for a router built in process in front of engines that
    # report none (tests' fakes): used only while no engine has reported. The
    # router process leaves it None.
    max_model_len: Optional[int] = None
    tokenizer: Any = None
    aliases: set[str] = field(default_factory=set)  # other names accepted in requests
    # --served-model-name: when set, the only names requests may give, each
    # listed by /v1/models, the first the one answers report (as vLLM's flag).
    served_names: list[str] = field(default_factory=list)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    def __init__(self, model: ServedModel, dispatcher: Dispatcher, prompts: PromptPool,
                 reports: Optional[EngineReports] = None) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.prompts = prompts
        if reports is None:  # the reports of the pools the dispatcher routes to
            reports = EngineReports(model.model_id, [dispatcher.prefill, dispatcher.decode])
        self.reports = reports
        self.vocab_size = len(model.tokenizer)

    def view(self) -> ModelView:
        """The model and context the engines report now; DispatchError
        UNAVAILABLE (HTTP 503 with Retry-After) while none has."""
        view = self.reports.view()
        if view is None and self.model.max_model_len is not None:
            view = ModelView(self.model.model_id, self.model.max_model_len, 0)
        if view is None:
            raise DispatchError("no engine instance has reported its model and context length yet; "
                                "retry shortly", grpc.StatusCode.UNAVAILABLE)
        if self.model.served_names:  # what answers report as their model
            view = dataclasses.replace(view, model_id=self.model.served_names[0])
        return view

    def model_names(self, view: ModelView) -> list[str]:
        """The names /v1/models lists, each a model object."""
        return list(self.model.served_names) or [view.model_id]

    def check_model(self, name: Optional[str]) -> None:
        if not name:
            return
        names = self.model.served_names
        if not names:
            if name in self.model.aliases:
                return
            names = [self.view().model_id]
        if name not in names:
            raise InvalidRequest(f"The model {name!r} does not exist; this server serves "
                                 f"{', '.join(map(repr, names))} (see GET /v1/models).",
                                 param="model", status=404, code="model_not_found")

    # --- sampling parameters ----------------------------------------------------------

    def finalize_params(self, prompt_len: int, params: common_pb2.SamplingParams,
                        max_model_len: int) -> SamplingParams:
        """The request's parameters validated by the engine's own rules, with
        max_tokens fitted to the context (max_model_len, the limit its prompt
        was checked against): an unset one becomes what the context leaves.
        The prompt is shorter than the context (the PromptPool checked it)."""
        from tandem.services.common.proto_convert import sampling_params_from_proto

        limit = max_model_len
        if not params.HasField("max_tokens"):
            params.max_tokens = limit - prompt_len
        elif params.max_tokens >= 1 and prompt_len + params.max_tokens > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
                f"and max_tokens asks for {params.max_tokens} more. Lower max_tokens to at most "
                f"{limit - prompt_len} or shorten the prompt.",
                param="max_tokens", code="context_length_exceeded")
        try:
            checked = sampling_params_from_proto(params)
        except SamplingParamsError as exc:
            raise InvalidRequest(str(exc), param=exc.field) from None
        if any(t >= self.vocab_size for t in checked.stop_token_ids):
            raise InvalidRequest("stop_token_ids: outside the vocabulary", param="stop_token_ids")
        if checked.logit_bias and any(t >= self.vocab_size for t in checked.logit_bias):
            raise InvalidRequest(f"logit_bias: token ids must be in [0, {self.vocab_size})", param="logit_bias")
        return checked

    # --- generation ------------------------------------------------------------------

    def generate(self, request_id: str, prompt: list[int],
                 params: SamplingParams) -> AsyncIterator[tuple[int, Delta]]:
        """n choices as n independent pipelines (request ids {id}-{i}; the
        parameters of each from SamplingParams.choices), interleaved as
        (choice index, delta)."""
        from tandem.services.common.proto_convert import sampling_params_to_proto

        streams = [self.dispatcher.generate(f"{request_id}-{i}", prompt, sampling_params_to_proto(p))
                   for i, p in enumerate(params.choices())]
        return merge_choices(streams)
