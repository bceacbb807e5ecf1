"""A request and its sampling parameters.

Progress is two numbers (thesis 4.4): `num_computed_tokens` (tokens whose KV
is in the cache) and `num_tokens` (prompt + output tokens known so far). A
prefill is a large step, a decode a step of one, a prefix-cache hit or a KV
transfer starts num_computed_tokens above zero, preemption resets it to zero
(a swapped-out request keeps its KV in host slots and gets it back at
re-admission, like a prefix-cache hit).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from tandem.engine.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from tandem.engine.detokenizer import Detokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed this request alone (RequestFailedError)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class SamplingParamsError(ValueError):
    """A request parameter is out of range; the message names the field."""

    @property
    def field(self) -> str:
        return str(self).split(":", 1)[0]


class RequestFailedError(RuntimeError):
    """The engine failed one request (and only it) while running it. `field`
    names the parameter that caused it when one did; the engine keeps stepping."""

    def __init__(self, message: str, field: Optional[str] = None, caused_by_request: bool = True) -> None:
        super().__init__(message)
        self.field = field
        # True: the request's own parameters or input caused it (a client
        # error, HTTP 400); False: the engine broke on it (HTTP 500).
        self.caused_by_request = caused_by_request


# Integer fields travel as protobuf int32/int64: a value outside them cannot
# cross the wire, so it is refused here, where every entry validates.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The sampler computes in float32: a value that is a subnormal there (or
# rounds to one on the wire) loses its precision and turns divisions into
# infinities. Zero stays allowed where the field allows it.
FLOAT32_TINY = 1.1754943508222875e-38


def choice_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of choice `index` of a request with n > 1: seed + index,
    wrapped around within int64 so that it still fits the wire."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


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
    # token id -> added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: Optional[dict[int, float]] = None
    # The output follows a JSON schema, regex, choice or grammar (grammar.py)
    structured_outputs: Optional[StructuredOutputs] = None

    MAX_N = 16
    MAX_LOGPROBS = 20
    MAX_STOP = 16
    MAX_LOGIT_BIAS = 300  # OpenAI's limit on entries
    LOGIT_BIAS_RANGE = (-100.0, 100.0)
    # Where the float32 sampler computes without overflow: logits (|x| < 1e4
    # for any trained model) / penalty / temperature stay far below 3.4e38.
    TEMPERATURE_RANGE = (0.0, 100.0)
    REPETITION_PENALTY_RANGE = (0.01, 100.0)
    OPENAI_PENALTY_RANGE = (-2.0, 2.0)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def choices(self) -> list[SamplingParams]:
        """Parallel sampling as n independent requests: the n single-choice
        parameter sets, choice i seeded with choice_seed(seed, i) so that the
        choices differ and each is reproducible on its own. The offline LLM
        and the router both fan out through this."""
        return [dataclasses.replace(self, n=1, seed=choice_seed(self.seed, i)) for i in range(self.n)]

    def validate(self) -> None:
        """The one check of sampling parameters every entry runs (HTTP, gRPC,
        the roles' internal calls, the offline LLM): raises
        SamplingParamsError("<field>: <why>") for the first bad field."""
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(f"{name}: {why}")

        def integer(name: str, lo: int, hi: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                bad(name, f"must be an integer, got {value!r}")
            if not lo <= value <= hi:
                bad(name, f"must be between {lo} and {hi}, got {value}")

        def real(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(name, f"must be a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                bad(name, f"must be a finite number, got {value}")
            if value != 0.0 and abs(value) < FLOAT32_TINY:
                bad(name, f"{value!r} is too close to zero to compute with (a float32 subnormal); "
                          "use 0 or a value of normal size")
            if not (lo < value <= hi if lo_open else lo <= value <= hi):
                interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
                bad(name, f"must be in {interval}, got {value}")

        integer("n", 1, self.MAX_N)
        integer("max_tokens", 1, INT32_MAX, optional=True)
        integer("min_tokens", 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        integer("top_k", -1, INT32_MAX)
        integer("logprobs", 0, self.MAX_LOGPROBS, optional=True)
        integer("seed", INT64_MIN, INT64_MAX, optional=True)
        real("temperature", *self.TEMPERATURE_RANGE)
        real("top_p", 0.0, 1.0, lo_open=True)
        real("min_p", 0.0, 1.0)
        real("repetition_penalty", *self.REPETITION_PENALTY_RANGE)
        real("presence_penalty", *self.OPENAI_PENALTY_RANGE)
        real("frequency_penalty", *self.OPENAI_PENALTY_RANGE)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > self.MAX_STOP:
            bad("stop", f"at most {self.MAX_STOP} stop strings")
        if not isinstance(self.stop_token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX
                for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        self._validate_logit_bias(bad)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad("structured_outputs", "must be a StructuredOutputs")
            if self.ignore_eos:
                # A finished grammar allows only EOS: ignoring it leaves no token to sample.
                bad("ignore_eos", "cannot be combined with structured outputs: the output ends "
                                  "where the grammar does")

    def _validate_logit_bias(self, bad) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            bad("logit_bias", "must map token ids to numbers")
        if len(bias) > self.MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {self.MAX_LOGIT_BIAS} entries, got {len(bias)}")
        lo, hi = self.LOGIT_BIAS_RANGE
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
                bad("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not lo <= value <= hi:
                bad("logit_bias", f"the bias of token {token} must be a number in [{lo:g}, {hi:g}], "
                                  f"got {value!r}")


@dataclass
class TokenLogprob:
    """Logprob of the chosen token and the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


# A request without proposed tokens (shared, never mutated).
NO_DRAFTS: list[int] = []


class Request:
    """One request's whole state: its tokens and progress, the KV blocks it
    holds and their names, its text so far. It is freed by one call
    (Scheduler.finish), and nothing else keeps state keyed by its id but the
    runner's copy of its block ids (dropped at the next plan) and the
    connector's own work for it (ended by request_finished)."""

    # Slots: the scheduler reads several fields of every running request each
    # step, right after a GPU step has left the caches cold; compact fields
    # span fewer cache lines than a dict's.
    __slots__ = ("request_id", "params", "eos_token_id", "arrival_time", "prompt_token_ids",
                 "num_prompt_tokens", "output_token_ids", "all_token_ids", "num_computed_tokens", "status",
                 "logprobs", "num_cached_tokens", "num_external_tokens", "num_preemptions", "stop_reason",
                 "kv_transfer_params", "stop_token_set", "blocks", "block_ids", "num_named_blocks",
                 "block_hashes", "host_slots", "num_host_tokens", "detokenizer", "generator", "device_generator",
                 "grammar", "spec_token_ids", "pending_token_row", "__weakref__")

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
        self.num_prompt_tokens = len(self.prompt_token_ids)  # the prompt never changes
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
        # Set by the connector: blocks loaded from outside must not be recomputed.
        self.kv_transfer_params: dict = {}
        # Checked for every sampled token: a set, since a client may send the whole vocabulary.
        self.stop_token_set = frozenset(params.stop_token_ids)
        # KV blocks (KVCacheManager's): the blocks held, their ids (the block
        # table: only ever appended to while the blocks are held; freeing starts
        # new lists), how many leading ones are named in the prefix cache, and
        # the chained hashes of every full block of all_token_ids so far.
        self.blocks: list = []
        self.block_ids: list[int] = []
        self.num_named_blocks = 0
        self.block_hashes: list[bytes] = []
        # Swapped out by a preemption (kv_swapper.py): the host-tier slots that
        # hold its first num_host_tokens tokens' KV, block by block, until it resumes.
        self.host_slots: list[int] = []
        self.num_host_tokens = 0
        self.detokenizer: Optional[Detokenizer] = None  # set by the engine when it has a tokenizer
        self.generator: Any = None  # the sampler's torch.Generator when params.seed is set
        self.device_generator: Any = None  # ditto on the GPU, when the batch is sampled there (device_sampling.py)
        # Structured outputs: the grammar matcher, advanced with each token
        # (set by the engine once the grammar is compiled; structured_output_manager.py)
        self.grammar: Any = None
        # Speculative decoding: tokens proposed to follow all_token_ids, verified
        # at the request's next step (the scheduler takes them: NO_DRAFTS again).
        self.spec_token_ids: list[int] = NO_DRAFTS
        # Asynchronous scheduling: the token this request sampled in the step
        # still in flight is not known here yet; its row among that step's
        # sampled tokens (the next step's input reads it on the device), or -1.
        self.pending_token_row = -1

    # The unified progress rule: two numbers.
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """1 while a token sampled for it is on its way from the device, else 0."""
        return 1 if self.pending_token_row >= 0 else 0

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled (SRTF's Δ)."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    def ends_with_pending_token(self, max_model_len: int) -> bool:
        """The pending token is certainly its last (max_tokens or the context
        is reached with it): nothing is scheduled after it."""
        max_tokens = self.params.max_tokens
        return self.pending_token_row >= 0 and (
            (max_tokens is not None and self.num_output_tokens + 1 >= max_tokens)
            or self.num_tokens + 1 >= max_model_len)

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

    def take_token(self, token_id: int, logprob: Optional[TokenLogprob], max_model_len: int,
                   detokenize: bool = True) -> Optional[RequestStatus]:
        """Append a sampled token and apply the stop rules to it: EOS and stop
        token ids (once min_tokens is reached), stop strings (the text is cut
        there), then max_tokens and the model's context. Returns the finished
        status, or None while the request goes on. detokenize=False leaves the
        text to the caller (a request without stop strings, whose text stops nothing)."""
        outputs = self.output_token_ids
        outputs.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        params = self.params
        num_outputs = len(outputs)
        status = None
        if num_outputs > params.min_tokens:
            if token_id == self.eos_token_id and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in self.stop_token_set:
                status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        detok = self.detokenizer if detokenize else None
        stop_str = detok.add(token_id) if detok is not None else None
        if status is None and stop_str is not None:
            status, self.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (num_outputs >= params.max_tokens or len(self.all_token_ids) >= max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and detok is not None:
            # The bytes of an unfinished character join the text now; a stop
            # string they complete outranks the length limit, as it would
            # have had they been decoded with the rest.
            stop_str = detok.finish()
            if stop_str is not None and status is RequestStatus.FINISHED_LENGTH:
                status, self.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        return status

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
