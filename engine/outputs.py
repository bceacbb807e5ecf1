"""What the engine hands back for each request after a step."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Union

from tandem.engine.request import RequestFailedError, TokenLogprob

# The kv_transfer_params of an unfinished request's output (shared, read-only:
# this is made for every request every step).
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
