"""/v1/chat/completions and /v1/completions: what each checks beyond the
prompt, the sampling parameters it asks for, and the shape of its answer.
Streaming, collecting and usage are answers.py's, shared by both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from tandem.engine.request import SamplingParams
from tandem.services.router.answers import Choice, Generation, answer
from tandem.services.router.beam import beam_params, beam_search, beam_width
from tandem.services.router.dispatch import Delta, merge_choices
from tandem.services.router.frontend import Frontend, InvalidRequest, ModelView, new_request_id
from tandem.services.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                    LogprobFormatter, now)
from tandem.services.router.prompter import Prepared
from tandem.services.router.telemetry import RequestClock


@dataclass
class ChatShape:
    formatter: LogprobFormatter
    logprobs: Optional[int]  # None: not asked for

    chunk_object = "chat.completion.chunk"
    final_object = "chat.completion"

    def opening(self, num_choices: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def chunk_choice(self, index: int, delta: Delta, text_offset: int) -> Optional[dict]:
        lps = {"content": self.formatter.chat(delta.logprobs)} if self.logprobs is not None else None
        if not (delta.text or delta.finish_reason or lps):
            return None
        return {"index": index, "delta": {"content": delta.text} if delta.text else {}, "logprobs": lps,
                "finish_reason": delta.finish_reason}

    def final_choice(self, index: int, choice: Choice) -> dict:
        lps = {"content": self.formatter.chat(choice.logprobs)} if self.logprobs is not None else None
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": lps, "finish_reason": choice.finish_reason}


@dataclass
class CompletionShape:
    formatter: LogprobFormatter
    logprobs: Optional[int]

    chunk_object = "text_completion"
    final_object = "text_completion"

    def opening(self, num_choices: int) -> list[dict]:
        return []

    def chunk_choice(self, index: int, delta: Delta, text_offset: int) -> Optional[dict]:
        lps = self.formatter.completion(delta.logprobs, text_offset) if self.logprobs is not None else None
        if not (delta.text or delta.finish_reason or lps):
            return None
        return {"index": index, "text": delta.text, "logprobs": lps, "finish_reason": delta.finish_reason}

    def final_choice(self, index: int, choice: Choice) -> dict:
        lps = self.formatter.completion(choice.logprobs, 0) if self.logprobs is not None else None
        return {"index": index, "text": choice.text, "logprobs": lps, "finish_reason": choice.finish_reason}


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


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
        params = self.frontend.finalize_params(len(prompt), body.sampling_params(max_tokens, logprobs),
                                               view.max_model_len)
        request_id = new_request_id("chatcmpl")
        n = params.n
        generation = Generation(request_id, now(), view.model_id,
                                self._choices(body, request_id, prompt, params),
                                num_choices=n, choices_per_prompt=n)
        return await answer(request, generation, ChatShape(self.formatter, logprobs), clock,
                            body.stream, _include_usage(body))

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
        if body.echo:
            raise InvalidRequest("echo: not supported", param="echo")
        if body.suffix:
            raise InvalidRequest("suffix: not supported", param="suffix")
        n = body.n
        request_id = new_request_id("cmpl")
        created = now()
        per_prompt = []
        for pi, prompt in enumerate(prepared.prompts):
            params = self.frontend.finalize_params(
                len(prompt), body.sampling_params(body.max_tokens, body.logprobs), view.max_model_len)
            per_prompt.append(self._choices(body, f"{request_id}-p{pi}", prompt, params))

        async def flat() -> AsyncIterator[tuple[int, Delta]]:
            # Prompt pi's choice ci is choice pi*n+ci of the answer.
            async for pi, (ci, d) in merge_choices(per_prompt):
                yield pi * n + ci, d

        generation = Generation(request_id, created, view.model_id, flat(),
                                num_choices=len(per_prompt) * n, choices_per_prompt=n)
        return await answer(request, generation, CompletionShape(self.formatter, body.logprobs), clock,
                            body.stream, _include_usage(body))
