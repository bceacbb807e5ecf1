"""Next-token sampling for a batch of sequences with per-request parameters.
On a GPU the batch is sampled there (device_sampling.py: the same pipeline,
batched); this module's row-by-row code runs on the CPU and is its oracle.

Order of processing: the grammar's token mask (structured outputs) ->
logit_bias -> penalties -> min_tokens masking -> temperature -> top-k ->
top-p -> min-p -> draw. Logprobs are those of the model's distribution after
the grammar's mask (tokens it forbids cannot be chosen, as in vLLM) and
before logit_bias, penalties and temperature, as OpenAI and vLLM report them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from tandem.engine import device_sampling
from tandem.engine.grammar import TokenMasks
from tandem.engine.request import Request, RequestFailedError, SamplingParams, TokenLogprob
from tandem.engine.row_argmax import row_argmax

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprob]]
    # Row -> why that request could not be sampled. Its token id is a
    # placeholder; the engine fails the request alone and keeps stepping.
    errors: dict[int, RequestFailedError] = field(default_factory=dict)


@dataclass
class PendingSample:
    """A step's sampling queued where its logits are: `tokens` there (the next
    step's inputs read them without a round trip) and result(), which waits
    for them to reach the host (asynchronous scheduling)."""

    tokens: torch.Tensor
    result: Callable[[], SampleResult]


def plain_greedy(r: Request) -> bool:
    p = r.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and r.num_output_tokens >= p.min_tokens and not p.logit_bias)


def _sampling_fields(r: Request) -> str:
    """The request's sampling parameters that differ from their defaults, for an error message."""
    p = r.params
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "min_tokens")
    given = [f"{n}={getattr(p, n)!r}" for n in names if getattr(p, n) != getattr(SamplingParams, n)]
    return ", ".join(given) or "the defaults"


def _nothing_allowed(r: Request) -> RequestFailedError:
    name = r.params.structured_outputs.field_name if r.params.structured_outputs else "sampling"
    return RequestFailedError(f"{name}: the grammar allows no token of the vocabulary here", field=name)


def no_probability_error(r: Request) -> RequestFailedError:
    return RequestFailedError(f"sampling: this request's parameters ({_sampling_fields(r)}) left no "
                              "finite token probability; use values of ordinary size")


def token_logprob(row: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """The chosen token's logprob in `row` (a log_softmax) and the top num_top alternatives."""
    top: dict[int, float] = {}
    if num_top > 0:
        values, ids = torch.topk(row, num_top)
        # A grammar may leave fewer than k tokens: forbidden ones are not alternatives.
        top = {t: v for t, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")}
    return TokenLogprob(token, float(row[token]), top)


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._default = torch.Generator(device="cpu")
        self._default.manual_seed(torch.initial_seed() & 0xFFFF_FFFF)

    def generator(self, request: Request) -> torch.Generator:
        """A seeded request's own generator (kept on the request, so it goes
        with it), else the shared one."""
        seed = request.params.seed
        if seed is None:
            return self._default
        if request.generator is None:
            request.generator = torch.Generator(device="cpu")
            # manual_seed takes [-2**63, 2**64); every int64 seed fits.
            request.generator.manual_seed(seed)
        return request.generator

    @torch.inference_mode()  # the logits are the model's inference tensors; penalties edit them in place
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 token_masks: Optional[TokenMasks] = None) -> SampleResult:
        """token_masks: the grammar masks of the constrained requests
        (StructuredOutputManager.bitmask), applied first."""
        logits = logits[:, : self.vocab_size]
        if token_masks is not None:
            token_masks.apply(logits)
        if all(plain_greedy(r) for r in requests):
            # The common serving case: argmax where the logits are, move only ids.
            if token_masks is None:
                return SampleResult(row_argmax(logits).tolist(), [None] * len(requests))
            best, tokens = logits.max(dim=-1)
            # -1 marks a row the grammar left empty; one transfer for both.
            return self._masked_greedy(torch.where(torch.isneginf(best), -1, tokens).tolist(), requests)
        if logits.is_cuda:
            try:
                return device_sampling.sample(logits, requests, self.vocab_size)
            except Exception:  # the rows one by one on the CPU below: only a broken request fails
                log.exception("sampling the batch on %s failed; sampling it on the CPU", logits.device)
        logits = logits.float().cpu()
        try:
            return self._sample(logits, requests)
        except Exception:
            if len(requests) == 1:
                log.exception("sampling failed for request %s", requests[0].request_id)
                return SampleResult([0], [None], {0: self._unexpected(requests[0])})
        # Some row broke the batch: sample row by row so only its request fails.
        out = SampleResult([], [])
        for i, r in enumerate(requests):
            try:
                one = self._sample(logits[i:i + 1], [r])
            except Exception:
                log.exception("sampling failed for request %s", r.request_id)
                one = SampleResult([0], [None], {0: self._unexpected(r)})
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            if one.errors:
                out.errors[i] = one.errors[0]
        return out

    def launch(self, logits: torch.Tensor, requests: Sequence[Request]) -> PendingSample:
        """Queue the batch's sampling without waiting for it. The batch needs
        nothing the host learns from this step (the engine samples constrained
        batches through __call__); on the CPU it is sampled now."""
        logits = logits[:, : self.vocab_size]
        if all(plain_greedy(r) for r in requests):
            tokens = row_argmax(logits)
            host = device_sampling.to_host(tokens)
            copied = torch.cuda.current_stream(logits.device).record_event() if logits.is_cuda else None

            def greedy() -> SampleResult:
                if copied is not None:
                    copied.synchronize()
                return SampleResult(host.tolist(), [None] * len(requests))
            return PendingSample(tokens, greedy)
        if logits.is_cuda:
            try:
                return PendingSample(*device_sampling.launch(logits, requests, self.vocab_size))
            except Exception:  # __call__ below falls back to the CPU, row by row
                log.exception("sampling the batch on %s failed; sampling it on the CPU", logits.device)
        done = self(logits, requests)
        return PendingSample(torch.tensor(done.token_ids, device=logits.device), lambda: done)

    @staticmethod
    def _masked_greedy(tokens: list[int], requests: Sequence[Request]) -> SampleResult:
        # A grammar that allows no token leaves a row of -inf, whose argmax
        # would be an arbitrary token: that request fails instead.
        errors = {i: _nothing_allowed(requests[i]) for i, t in enumerate(tokens) if t < 0}
        return SampleResult([max(t, 0) for t in tokens], [None] * len(requests), errors)

    @staticmethod
    def _unexpected(r: Request) -> RequestFailedError:
        return RequestFailedError(f"sampling failed with this request's parameters ({_sampling_fields(r)})")

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SampleResult:
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.apply_logit_bias(logits, requests)
        logits = self._apply_penalties(logits, requests)
        masked = self._mask_early_stop(logits, requests)
        errors = self._check_rows(logits, requests, masked)
        tokens = self._draw(logits, requests, errors)
        logprobs: list[Optional[TokenLogprob]] = []
        for i, (r, t) in enumerate(zip(requests, tokens)):
            if r.params.logprobs is None or i in errors:
                logprobs.append(None)
                continue
            logprobs.append(token_logprob(raw_logprobs[i], t, r.params.logprobs))
        return SampleResult(tokens, logprobs, errors)

    def _check_rows(self, logits: torch.Tensor, requests: Sequence[Request],
                    masked: set[int]) -> dict[int, RequestFailedError]:
        """Rows no token can be drawn from: a NaN or +inf anywhere (penalties
        out of float32's reach), or every token at -inf (min_tokens banning
        the whole vocabulary through stop_token_ids and EOS)."""
        broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=1)
        empty = torch.isneginf(logits).all(dim=1)
        errors: dict[int, RequestFailedError] = {}
        for i in (broken | empty).nonzero().flatten().tolist():
            r = requests[i]
            if bool(empty[i]) and i in masked:
                errors[i] = RequestFailedError(
                    "min_tokens: while it holds, stop_token_ids and EOS ban every token of the "
                    "vocabulary, so no token can be sampled", field="min_tokens")
            elif bool(empty[i]) and r.grammar is not None:
                errors[i] = _nothing_allowed(r)
            else:
                errors[i] = no_probability_error(r)
        return errors

    # The edits before the draw are the device sampler's, on the CPU's rows too.
    @staticmethod
    def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        device_sampling.apply_logit_bias(logits, requests)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        device_sampling.apply_penalties(logits, requests, self.vocab_size)
        return logits

    def _mask_early_stop(self, logits: torch.Tensor, requests: Sequence[Request]) -> set[int]:
        """-inf for stop tokens and EOS while min_tokens holds; returns the rows masked."""
        return device_sampling.mask_early_stop(logits, requests, self.vocab_size)

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request],
              errors: dict[int, RequestFailedError]) -> list[int]:
        greedy = [r.params.greedy for r in requests]
        tokens = logits.argmax(dim=-1).tolist()
        if all(greedy):
            return tokens
        for i, r in enumerate(requests):
            if greedy[i] or i in errors:
                continue
            probs = self.filtered_probs(logits[i], r)
            total = float(probs.sum())
            if not math.isfinite(total) or total <= 0.0 or not bool(torch.isfinite(probs).all()):
                # Finite logits can still overflow once divided by the temperature.
                errors[i] = no_probability_error(r)
                continue
            tokens[i] = int(torch.multinomial(probs, 1, generator=self.generator(r)))
        return tokens

    @staticmethod
    def filtered_probs(row: torch.Tensor, r: Request) -> torch.Tensor:
        p = r.params
        row = row / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()
