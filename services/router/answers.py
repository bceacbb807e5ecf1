"""One path from a generation's interleaved choices to the client, for chat
and completions alike: streamed as server-sent events (include_usage,
logprobs, n choices interleaved as they come) or collected into one JSON
object. An endpoint supplies only its Shape: how a choice looks in a chunk
and in the final object, and what opens the stream.

Usage counts every choice's completion tokens and each prompt once: with
`choices_per_prompt` = n, choices i*n .. i*n+n-1 share prompt i.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.services.router.dispatch import Delta
from tandem.services.router.openai_protocol import usage_body
from tandem.services.router.sse import ClientGone, primed, sse_response, until_disconnect
from tandem.services.router.telemetry import RequestClock


@dataclass
class Choice:
    """One choice collected whole (the non-streaming answer)."""

    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, delta: Delta, count_prompt: bool) -> None:
        self.completion_tokens += delta.num_output_tokens
        if count_prompt:
            self.prompt_tokens += delta.num_prompt_tokens
            self.cached_tokens += delta.num_cached_tokens

    def body(self) -> dict:
        return usage_body(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class Shape(Protocol):
    chunk_object: str  # "object" of each streamed chunk
    final_object: str  # "object" of the collected answer

    def opening(self, num_choices: int) -> list[dict]:
        """Choices of the chunks sent before any token (chat: the role)."""

    def chunk_choice(self, index: int, delta: Delta, text_offset: int) -> Optional[dict]:
        """A delta as a chunk's choice, or None when it has nothing to send.
        text_offset: characters of this choice's text sent before it."""

    def final_choice(self, index: int, choice: Choice) -> dict:
        """A whole choice in the collected answer."""


@dataclass
class Generation:
    """One request's choices as they come from the tiers, (index, delta)."""

    request_id: str
    created: int
    model_id: str
    deltas: AsyncIterator[tuple[int, Delta]]
    num_choices: int
    choices_per_prompt: int

    def envelope(self, object_name: str, choices: list[dict], usage: Optional[dict] = None) -> dict:
        body = {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model_id, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


async def answer(request: Request, generation: Generation, shape: Shape, clock: RequestClock,
                 stream: bool, include_usage: bool) -> Response:
    if not stream:
        choices, usage = await _collect(request, generation, clock)
        return JSONResponse(generation.envelope(
            shape.final_object, [shape.final_choice(i, c) for i, c in enumerate(choices)], usage.body()))
    # The status line waits for the first delta: a request refused downstream
    # gets its real status, not a 200 and an error event.
    generation.deltas = await primed(request, generation.deltas)
    return sse_response(request, _events(generation, shape, clock, include_usage), clock)


async def _events(generation: Generation, shape: Shape, clock: RequestClock,
                  include_usage: bool) -> AsyncIterator[dict]:
    usage = Usage()
    offsets: dict[int, int] = {}
    for choice in shape.opening(generation.num_choices):
        yield generation.envelope(shape.chunk_object, [choice])
    async for index, d in generation.deltas:
        clock.on_tokens(len(d.token_ids))
        choice = shape.chunk_choice(index, d, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(d.text)
        if choice is not None:
            yield generation.envelope(shape.chunk_object, [choice])
        if d.finish_reason:
            usage.add(d, count_prompt=index % generation.choices_per_prompt == 0)
    if include_usage:
        yield generation.envelope(shape.chunk_object, [], usage.body())


async def _collect(request: Request, generation: Generation,
                   clock: RequestClock) -> tuple[list[Choice], Usage]:
    choices: dict[int, Choice] = {}
    usage = Usage()

    async def consume() -> None:
        async for index, d in generation.deltas:
            clock.on_tokens(len(d.token_ids))
            c = choices.setdefault(index, Choice())
            c.text += d.text
            c.logprobs.extend(d.logprobs)
            if d.finish_reason:
                c.finish_reason = d.finish_reason
                usage.add(d, count_prompt=index % generation.choices_per_prompt == 0)

    work = asyncio.create_task(consume())
    await until_disconnect(request, work)
    if work.cancelled():
        raise ClientGone()
    work.result()  # re-raises DispatchError
    return [choices[i] for i in sorted(choices)], usage
