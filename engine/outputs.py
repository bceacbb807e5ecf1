"""What the engine hands back for each request after a step."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Union

from tandem.engine.request import Request, RequestFailedError, RequestStatus, TokenLogprob

# What an output without logprobs, or an unfinished request's output, carries
# as its logprobs and kv_transfer_params: shared and read-only, since an
# output is made for every request every step.
NO_LOGPROBS: tuple = ()
NO_PARAMS: Mapping = MappingProxyType({})


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (deltas), plus running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: Sequence[TokenLogprob]
    finished: bool
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    stop_reason: Optional[Union[str, int]] = None
    # Set on a finished request by the connector: e.g. a DirectHandle to the
    # prompt's blocks, which the decode engine copies (connector/direct.py).
    kv_transfer_params: Mapping = field(default_factory=lambda: NO_PARAMS)
    # finish_reason "error": why the engine failed this request (and only it).
    error: Optional[RequestFailedError] = None


def request_output(request: Request, token_ids: list[int], text: str, logprobs: Sequence,
                   status: Optional[RequestStatus]) -> RequestOutput:
    """The output of one step of `request`: these new tokens and their text;
    `status` when it finished. Positional: this runs for every request every step."""
    if status is None:
        return RequestOutput(request.request_id, token_ids, text, logprobs, False, None,
                             request.num_prompt_tokens, len(request.output_token_ids),
                             request.num_cached_tokens, request.num_external_tokens, request.stop_reason,
                             NO_PARAMS)
    return RequestOutput(request.request_id, token_ids, text, logprobs, True, status.value,
                         request.num_prompt_tokens, len(request.output_token_ids),
                         request.num_cached_tokens, request.num_external_tokens, request.stop_reason,
                         request.kv_transfer_params)


def take_external_tokens(request: Request, token_ids: list[int], max_model_len: int) -> RequestOutput:
    """Tokens sampled elsewhere (a prefill's first token), for a request not
    yet added: the same stop rules and text as sampled ones, counted as
    generated there. A stop only marks the request finished (it holds
    nothing yet); the output carries the tokens taken."""
    status = None
    taken: list[int] = []
    text = ""
    for token in token_ids:
        status = request.take_token(token, None, max_model_len)
        taken.append(token)
        if request.detokenizer is not None:
            text += request.detokenizer.delta(status is not None)
        if status is not None:
            request.status = status
            break
    return request_output(request, taken, text, [], status)
