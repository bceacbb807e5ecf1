"""Beam search through the tiers (vLLM's `use_beam_search` extra).

The router runs the search (engine/beam_search.py, the same state machine as
the offline LLM.beam_search) and scores each live beam with one ordinary
single-token request through the dispatcher: prompt + beam tokens, greedy,
2*beam_width logprobs. The engines need nothing new, and their prefix caches
share the beams' common blocks. The n best finished beams become the
answer's choices, each as one whole delta once the search is done.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from tandem.engine.beam_search import BeamSearch, BeamSearchParams, BeamSearchParamsError
from tandem.engine.request import SamplingParams
from tandem.services.common.proto_convert import sampling_params_to_proto
from tandem.services.router.dispatch import Delta, Dispatcher
from tandem.services.router.prompter import InvalidRequest

# Fields the search does not apply: it ranks by the raw model distribution,
# deterministically. Asking for one with use_beam_search is a 400 naming it
# rather than silently ignoring it.
_UNUSED_WITH_BEAMS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "min_tokens",
                      "logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structured_outputs", "tools")
# Values of those fields that ask for nothing beam search does not do already.
_NEUTRAL = {"top_p": (1.0,), "top_k": (0, -1), "repetition_penalty": (1.0,)}


def beam_width(body: Any) -> Optional[int]:
    """The beam width a request asks for, or None without use_beam_search.
    Raises InvalidRequest for best_of without beam search and for fields the
    search does not apply."""
    best_of = body.best_of
    if best_of is not None and best_of < body.n:
        raise InvalidRequest(f"best_of: must be at least n ({body.n}), got {best_of}", param="best_of")
    if not body.use_beam_search:
        if best_of is not None and best_of != body.n:
            raise InvalidRequest("best_of: only supported with use_beam_search (as the beam width); "
                                 "sampling best_of > n is not offered", param="best_of")
        # Beam search's own settings would do nothing without it: say so.
        if body.length_penalty != 1.0 or body.early_stopping is not False:
            name = "length_penalty" if body.length_penalty != 1.0 else "early_stopping"
            raise InvalidRequest(f"{name}: only used by beam search; set use_beam_search", param=name)
        return None
    for name in _UNUSED_WITH_BEAMS:
        value = getattr(body, name, None)  # tools: chat only
        # Unset, 0 (temperature 0 is greedy, as the search is) or empty asks for nothing.
        if value not in (None, [], "", 0, {}) and value not in _NEUTRAL.get(name, ()):
            raise InvalidRequest(f"{name}: not supported with use_beam_search", param=name)
    if body.response_format is not None and body.response_format.type != "text":
        raise InvalidRequest("response_format: not supported with use_beam_search", param="response_format")
    # Chat's logprobs is a bool, completions' a count: either set asks for logprobs.
    if body.logprobs is not None and body.logprobs is not False:
        raise InvalidRequest("logprobs: not supported with use_beam_search", param="logprobs")
    return best_of or body.n


def beam_params(width: int, max_tokens: int, body: Any) -> BeamSearchParams:
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=body.length_penalty,
                                early_stopping=body.early_stopping, ignore_eos=body.ignore_eos)
    except BeamSearchParamsError as exc:
        # The width comes from best_of (or n): name the field the client sent.
        field = exc.field if exc.field != "beam_width" else ("best_of" if body.best_of else "n")
        raise InvalidRequest(f"{field}: {str(exc).split(': ', 1)[1]} (the beam width)"
                             if exc.field == "beam_width" else str(exc), param=field) from None


async def beam_search(dispatcher: Dispatcher, tokenizer: Any, request_id: str, prompt: list[int],
                      params: BeamSearchParams, n: int) -> AsyncIterator[tuple[int, Delta]]:
    """The n best beams of one prompt as (choice index, delta), one delta each."""
    search = BeamSearch(params, tokenizer.eos_token_id)
    # ignore_eos: with max_tokens=1 it changes nothing but keeps the engines'
    # min_tokens rules out of the way; the search decides what EOS means.
    step = sampling_params_to_proto(SamplingParams(max_tokens=1, temperature=0.0,
                                                   logprobs=params.num_logprobs, ignore_eos=True))
    round_ = 0
    while not search.done:
        tasks = [asyncio.ensure_future(_next_token_top(dispatcher, f"{request_id}-r{round_}-b{b}",
                                                       prompt + beam.token_ids, step))
                 for b, beam in enumerate(search.live)]
        try:
            tops = await asyncio.gather(*tasks)
        finally:
            # A failed beam (or a client gone) ends its siblings' calls too:
            # gather alone would leave them running.
            for task in tasks:
                task.cancel()
        search.advance(tops)
        round_ += 1
    for index, beam in enumerate(search.best(n)):
        yield index, Delta(token_ids=beam.token_ids,
                           text=tokenizer.decode(beam.token_ids, skip_special_tokens=True),
                           finish_reason=beam.finish_reason, num_prompt_tokens=len(prompt),
                           num_output_tokens=len(beam.token_ids))


async def _next_token_top(dispatcher: Dispatcher, request_id: str, ids: list[int], params: Any) -> dict[int, float]:
    top: dict[int, float] = {}
    async for delta in dispatcher.generate(request_id, ids, params):
        for lp in delta.logprobs:
            top = dict(lp.top)
    return top
