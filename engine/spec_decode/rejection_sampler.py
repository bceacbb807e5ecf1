"""Verification of draft tokens: which of them the target keeps, and the
target's own token after them, such that the output has exactly the
distribution the target alone would sample from (Leviathan et al., Chen et
al. 2023).

Request j proposed drafts d_1..d_k; the target computed k + 1 rows of
logits: row i is its distribution p_i at the position of d_i, row k + 1 the
one after d_k. Both proposers draft deterministically (prompt lookup; a
draft model's argmax), so each proposal distribution q_i is one-hot at d_i
and the general rule min(1, p/q) becomes:

- greedy: accept d_i while it is the argmax of p_i; the first mismatch is
  replaced by that argmax, and after k accepted drafts row k + 1's argmax
  follows. Greedy output is the target's own, token for token.
- sampled: accept d_i with probability p_i(d_i); on the first rejection
  draw from the residual max(0, p_i - q_i), that is p_i without d_i,
  renormalized; after k accepted drafts draw from p_{k+1}.

p_i is the distribution the ordinary sampler would draw from at that
position (logit_bias, temperature, top-k, top-p, min-p). Penalties, min_tokens
and grammars depend on the tokens before each position, so requests using
them never carry drafts (speculator.py decides); logprobs are those of the
raw rows, as the ordinary sampler reports them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from tandem.engine.request import Request, RequestFailedError, TokenLogprob
from tandem.engine.sampler import Sampler, no_probability_error, plain_greedy, token_logprob

log = logging.getLogger(__name__)


@dataclass
class VerifyResult:
    """Per request, in order: the tokens it takes (its accepted drafts, then
    the target's own), their logprobs (None without logprobs), and how many
    drafts were accepted. errors[j]: request j could not be verified; it fails alone."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Optional[TokenLogprob]]] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    errors: dict[int, RequestFailedError] = field(default_factory=dict)

    def add(self, tokens: list[int], logprobs: list[Optional[TokenLogprob]], num_accepted: int) -> None:
        self.token_ids.append(tokens)
        self.logprobs.append(logprobs)
        self.num_accepted.append(num_accepted)


def accept_greedy(best: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Drafts kept while each is the target's argmax, then the target's own token."""
    for i, draft in enumerate(drafts):
        if best[i] != draft:
            return [*drafts[:i], best[i]]
    return [*drafts, best[len(drafts)]]


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # its generators, logit_bias and filters

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 drafts: Sequence[Sequence[int]]) -> VerifyResult:
        """logits: 1 + len(drafts[j]) rows per request j, in order."""
        logits = logits[:, : self.sampler.vocab_size]
        counts = [1 + len(d) for d in drafts]
        out = VerifyResult()
        if all(plain_greedy(r) for r in requests):
            # The common case: argmax where the logits are, move only ids.
            best = logits.argmax(dim=-1).tolist()
            start = 0
            for d, n in zip(drafts, counts):
                tokens = accept_greedy(best[start:start + n], d)
                out.add(tokens, [None] * len(tokens), len(tokens) - 1)
                start += n
            return out
        logits = logits.float().cpu()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        rows_of = [r for r, n in zip(requests, counts) for _ in range(n)]
        logits = self.sampler.apply_logit_bias(logits.clone(), rows_of)
        start = 0
        for j, (r, d, n) in enumerate(zip(requests, drafts, counts)):
            rows = logits[start:start + n]
            try:
                tokens = self._verify(rows, r, d)
            except _NoProbability:
                out.errors[j] = no_probability_error(r)
                tokens = []
            except Exception:
                log.exception("verifying draft tokens failed for request %s", r.request_id)
                out.errors[j] = RequestFailedError("sampling failed while verifying draft tokens",
                                                   caused_by_request=False)
                tokens = []
            logprobs: list[Optional[TokenLogprob]] = [None] * len(tokens)
            if raw_logprobs is not None and r.params.logprobs is not None:
                logprobs = [token_logprob(raw_logprobs[start + i], t, r.params.logprobs)
                            for i, t in enumerate(tokens)]
            out.add(tokens, logprobs, max(len(tokens) - 1, 0))
            start += n
        return out

    def _verify(self, rows: torch.Tensor, r: Request, drafts: Sequence[int]) -> list[int]:
        if bool((torch.isnan(rows) | torch.isposinf(rows)).any()) or bool(torch.isneginf(rows).all(dim=1).any()):
            raise _NoProbability
        if r.params.greedy:
            return accept_greedy(rows.argmax(dim=-1).tolist(), drafts)
        generator = self.sampler.generator(r)
        tokens: list[int] = []
        for i, draft in enumerate(drafts):
            p = self._probs(rows[i], r)
            if float(torch.rand((), generator=generator)) < float(p[draft]):
                tokens.append(draft)
                continue
            residual = p.clone()
            residual[draft] = 0.0  # q is one-hot at the draft: max(0, p - q)
            if float(residual.sum()) <= 0.0:  # p was all on the draft: nothing else to draw
                residual = p
            tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
            return tokens
        tokens.append(int(torch.multinomial(self._probs(rows[len(drafts)], r), 1, generator=generator)))
        return tokens

    def _probs(self, row: torch.Tensor, r: Request) -> torch.Tensor:
        probs = self.sampler.filtered_probs(row, r)
        total = float(probs.sum())
        if not math.isfinite(total) or total <= 0.0 or not bool(torch.isfinite(probs).all()):
            raise _NoProbability
        return probs


class _NoProbability(Exception):
    """A row leaves no finite token probability (the request's parameters)."""
