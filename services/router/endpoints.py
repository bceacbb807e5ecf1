"""/v1/chat/completions and /v1/completions: what each checks beyond the
prompt, the sampling parameters it asks for, and the shape of its answer.
Streaming, collecting and usage are answers.py's, shared by both."""
from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.request import SamplingParams
from tandem.engine.structured_outputs import StructuredOutputs, StructuredOutputsError
from tandem.services.router.answers import Generation, answer
from tandem.services.router.beam import beam_params, beam_search, beam_width
from tandem.services.router.dispatch import Delta, merge_choices
from tandem.services.router.frontend import Frontend, InvalidRequest, ModelView, new_request_id
from tandem.services.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                    LogprobFormatter, now)
from tandem.services.router.prompter import Prepared
from tandem.services.router.shapes import ChatShape, CompletionShape
from tandem.services.router.tool_answers import ToolChatShape
from tandem.services.router.tool_calls import forced_constraint, parser_for
from tandem.services.router.telemetry import RequestClock


def _constraint(body) -> Optional[StructuredOutputs]:
    """The request's output constraint (response_format, structured_outputs,
    guided_*), checked for its shape here (and logit_bias's keys); the
    engines compile it, and a grammar that does not compile comes back from
    them as a 400."""
    try:
        body.logit_bias_ids()
        return body.structured_outputs_spec()
    except StructuredOutputsError as exc:
        field = str(exc).split(":", 1)[0]
        raise InvalidRequest(str(exc), param=field) from None


def _tool_constraint(body: ChatCompletionRequest) -> Optional[StructuredOutputs]:
    try:
        return forced_constraint(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="tool_choice") from None


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _ids(prefix: str, body) -> tuple[str, str]:
    """(the answer's id, the request id in the tiers). A client's request_id
    (vLLM's field) names the answer only: two clients may send the same one,
    and engines need ids unique among the requests they hold."""
    internal = new_request_id(prefix)
    return (f"{prefix}-{body.request_id}" if body.request_id else internal), internal


class OpenAIEndpoints:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.formatter = LogprobFormatter(frontend.model.tokenizer)

    async def chat(self, request: Request, prepared: Prepared, view: ModelView,
                   clock: RequestClock) -> Response:
        body: ChatCompletionRequest = prepared.body
        prompt = prepared.prompts[0]
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs set to true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        constraint = _constraint(body)
        shape = ChatShape(self.formatter, logprobs)
        if body.tools and body.tool_choice != "none":
            forced = _tool_constraint(body)
            if forced is not None and constraint is not None:
                raise InvalidRequest(f"tool_choice: a forced tool call is its own output constraint; "
                                     f"drop {constraint.field_name.split('.')[0]}", param="tool_choice")
            constraint = forced or constraint
            shape = ToolChatShape(self.formatter, logprobs,
                                  parser=None if forced else parser_for(self.frontend.model.tokenizer.chat_template),
                                  tool_choice=body.tool_choice, tool_names={t.function.name for t in body.tools},
                                  parallel=body.parallel_tool_calls)
        elif body.tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice: needs tools", param="tool_choice")
        params = self.frontend.finalize_params(
            len(prompt), body.sampling_params(max_tokens, logprobs, constraint), view.max_model_len)
        answer_id, request_id = _ids("chatcmpl", body)
        n = params.n
        generation = Generation(answer_id, now(), view.model_id,
                                self._choices(body, request_id, prompt, params),
                                num_choices=n, choices_per_prompt=n)
        return await answer(request, generation, shape, clock, body.stream, _include_usage(body))

    def _choices(self, body, request_id: str, prompt: list[int],
                 params: SamplingParams) -> AsyncIterator[tuple[int, Delta]]:
        """One prompt's n choices: sampled, or the n best beams of a beam search."""
        width = beam_width(body)
        if width is None:
            return self.frontend.generate(request_id, prompt, params)
        return beam_search(self.frontend.dispatcher, self.frontend.model.tokenizer, request_id, prompt,
                           beam_params(width, params.max_tokens, body), params.n)

    async def completion(self, request: Request, prepared: Prepared, view: ModelView,
                         clock: RequestClock) -> Response:
        body: CompletionRequest = prepared.body
        n = body.n
        answer_id, request_id = _ids("cmpl", body)
        created = now()
        per_prompt = []
        constraint = _constraint(body)
        for pi, prompt in enumerate(prepared.prompts):
            params = self.frontend.finalize_params(
                len(prompt), body.sampling_params(body.max_tokens, body.logprobs, constraint),
                view.max_model_len)
            per_prompt.append(self._choices(body, f"{request_id}-p{pi}", prompt, params))

        async def flat() -> AsyncIterator[tuple[int, Delta]]:
            # Prompt pi's choice ci is choice pi*n+ci of the answer.
            async for pi, (ci, d) in merge_choices(per_prompt):
                yield pi * n + ci, d

        generation = Generation(answer_id, created, view.model_id, flat(),
                                num_choices=len(per_prompt) * n, choices_per_prompt=n)
        return await answer(request, generation, CompletionShape(self.formatter, body.logprobs), clock,
                            body.stream, _include_usage(body))

    # --- vLLM's tokenizer endpoints (the work done in the PromptPool's workers) ---------

    async def tokenize(self, request: Request, prepared: Prepared, view: ModelView,
                       clock: RequestClock) -> Response:
        ids = prepared.prompts[0]
        body = {"count": len(ids), "max_model_len": view.max_model_len, "tokens": ids}
        if prepared.token_strs is not None:
            body["token_strs"] = prepared.token_strs
        return JSONResponse(body)

    async def detokenize(self, request: Request, prepared: Prepared, view: ModelView,
                         clock: RequestClock) -> Response:
        return JSONResponse({"prompt": prepared.text})
