"""A request and its sampling parameters.

Progress is two numbers (thesis 4.4): `num_computed_tokens` (tokens whose KV
is in the cache) and `num_tokens` (prompt + output tokens known so far). A
prefill is a large step, a decode a step of one, a prefix-cache hit or a KV
transfer starts num_computed_tokens above zero, preemption resets it to zero.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: Optional[int] = 16  # None: up to the model's context
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    repetition_penalty: float = 1.0  # HF semantics: over prompt and output
    presence_penalty: float = 0.0  # OpenAI semantics: over output only
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # None: no logprobs; k: chosen token + top-k
    min_tokens: int = 0

    MAX_N = 16
    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(f"{name}: {why}")

        if not (1 <= self.n <= self.MAX_N):
            bad("n", f"must be between 1 and {self.MAX_N}, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0):
            bad("temperature", f"must be between 0 and 100, got {self.temperature}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                bad(name, f"must be between -2 and 2, got {getattr(self, name)}")
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            bad("logprobs", f"must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "at most 16 stop strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")


@dataclass
class TokenLogprob:
    """Logprob of the chosen token and the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: Optional[int] = None, arrival_time: Optional[float] = None,
                 output_token_ids: Optional[list[int]] = None) -> None:
        if not prompt_token_ids:
            raise SamplingParamsError("prompt: must contain at least one token")
        self.request_id = request_id
        self.params = params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.prompt_token_ids = list(prompt_token_ids)
        # Tokens sampled elsewhere (a prefill service's first token) arrive here.
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.logprobs: list[TokenLogprob] = []
        self.num_cached_tokens = 0  # prompt tokens served from the local prefix cache
        self.num_external_tokens = 0  # ... and from the KV connector
        self.num_preemptions = 0
        self.stop_reason: Optional[str | int] = None
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        # Set by the connector: blocks loaded from outside must not be recomputed.
        self.kv_transfer_params: dict = {}
        self.decode_entry = None  # the scheduler's plan entry for this request's decode steps, reused

    # The unified progress rule: two numbers.
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled (SRTF's Δ)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int, logprob: Optional[TokenLogprob] = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
