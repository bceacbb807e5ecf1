"""Beam search as a pure state machine, one per prompt, apart from any engine.

Each step the caller scores every live beam (one single-token request per
beam: prompt + beam tokens, greedy, `2 * beam_width` raw logprobs) and hands
the top logprobs back. The prefix cache makes beams that share a prefix share
its KV blocks, so nothing here copies KV (the PagedAttention paper's sharing
case). The offline LLM (llm.py) and the router (services/router/beam.py)
drive the same BeamSearch, one synchronously, one over gRPC.

The selection and stopping rules are HF transformers' `_beam_search`, so that
the best sequence is the one `generate(num_beams=..., do_sample=False)`
returns for the same model:
- candidates: every live beam's score + each of its top tokens' logprob; keep
  the best 2*W (W = beam_width). Each beam has one EOS, so at least W of them
  are not EOS and the search can go on with W beams.
- a candidate that ends (EOS, or max_tokens reached) becomes a finished
  hypothesis only when it ranks among the first W of the 2*W; its score is
  sum_logprobs / generated_len ** length_penalty (generated_len counts EOS).
  The finished set keeps the best W.
- the next live beams: the best W candidates that did not end.
- stop when max_tokens is reached, or the finished set is full and
  early_stopping=True, or (the set full) the best live beam can no longer
  beat the worst finished one: its score over the current length (False,
  HF's default heuristic), or over max_tokens when early_stopping="never"
  and length_penalty > 0 (the best it could still reach).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

EarlyStopping = Union[bool, str]  # True, False or "never", as HF


class BeamSearchParamsError(ValueError):
    """A beam search parameter is out of range; the message starts with the field's name."""

    @property
    def field(self) -> str:
        return str(self).split(":", 1)[0]


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    ignore_eos: bool = False

    # Each step asks the engine for 2*beam_width logprobs per beam, and the
    # engine gives at most SamplingParams.MAX_LOGPROBS (20).
    MAX_BEAM_WIDTH = 10

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise BeamSearchParamsError(f"{name}: {why}")

        for name, lo, hi in (("beam_width", 1, self.MAX_BEAM_WIDTH), ("max_tokens", 1, 2**31 - 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                bad(name, f"must be an integer, got {value!r}")
            if not lo <= value <= hi:
                bad(name, f"must be between {lo} and {hi}, got {value}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp or abs(lp) > 100.0:
            bad("length_penalty", f"must be a number in [-100, 100], got {lp!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            bad("early_stopping", f"must be true, false or \"never\", got {self.early_stopping!r}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")

    @property
    def num_logprobs(self) -> int:
        """Logprobs each beam's request asks for: the 2*W best of one beam
        include every candidate of it that can rank among all beams' 2*W best."""
        return 2 * self.beam_width


@dataclass
class Beam:
    token_ids: list[int]  # generated tokens (EOS included when it ended there)
    cum_logprob: float  # sum of the raw logprobs of token_ids
    score: float = 0.0  # finished: cum_logprob / len(token_ids) ** length_penalty
    finish_reason: Optional[str] = None  # "stop" (EOS) or "length" once finished
    text: str = ""  # set by the driver once the search is done (it holds the tokenizer)


@dataclass
class BeamSearch:
    """The search for one prompt. `live` are the beams to score next; call
    advance() with their top logprobs, in the same order, until `done`."""

    params: BeamSearchParams
    eos_token_id: Optional[int]
    live: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    finished: list[Beam] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    # HF's is_early_stop_heuristic_unsatisfied: once False it stays False.
    _may_improve: bool = True

    def advance(self, tops: list[dict[int, float]]) -> None:
        """tops[i]: token id -> logprob, the top 2*W of live beam i's next token."""
        if self.done:
            raise RuntimeError("advance() after the search is done")
        if len(tops) != len(self.live):
            raise ValueError(f"{len(tops)} logprob sets for {len(self.live)} live beams")
        p, width = self.params, self.params.beam_width
        length = len(self.live[0].token_ids) + 1  # every live beam has the same length
        # Ties go to the lower beam, then the lower token id, as a flat
        # (beam * vocab + token) index would order them.
        candidates = sorted(((beam.cum_logprob + lp, b, t) for b, (beam, top) in enumerate(zip(self.live, tops))
                             for t, lp in top.items()), key=lambda c: (-c[0], c[1], c[2]))[:2 * width]
        at_limit = length >= p.max_tokens
        # Decided once per step, before any of this step's hypotheses join:
        # HF adds none once no better one is possible, nor (early_stopping=True)
        # once the set is full.
        may_add = self._may_improve and not (len(self.finished) == width and p.early_stopping is True)
        next_live: list[Beam] = []
        for rank, (cum, b, t) in enumerate(candidates):
            tokens = self.live[b].token_ids + [t]
            eos = t == self.eos_token_id and not p.ignore_eos
            if not (eos or at_limit):
                if len(next_live) < width:
                    next_live.append(Beam(tokens, cum))
            elif rank < width and may_add:
                self._add_finished(Beam(tokens, cum, cum / length ** p.length_penalty,
                                        "stop" if eos else "length"))
        self.live = next_live
        if next_live and len(self.finished) == width:
            best_len = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else length
            best_possible = next_live[0].cum_logprob / best_len ** p.length_penalty
            self._may_improve = self._may_improve and best_possible > self.finished[-1].score
        full_and_early = len(self.finished) == width and p.early_stopping is True
        self.done = not next_live or not self._may_improve or full_and_early

    def _add_finished(self, beam: Beam) -> None:
        # Earlier hypotheses win ties: HF merges the old set before the new ones.
        self.finished.append(beam)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.params.beam_width:]

    def best(self, n: Optional[int] = None) -> list[Beam]:
        """The n best finished hypotheses (all of them by default), best first."""
        return self.finished[: n if n is not None else len(self.finished)]
