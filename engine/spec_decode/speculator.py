"""The engine's side of speculative decoding: after each step, the requests
that go on get proposals (request.spec_token_ids) for their next step, which
the scheduler schedules with them and the rejection sampler verifies.

Which requests speculate: those whose next-token distribution does not
depend on the tokens before it beyond the model's own input, so that one
forward can verify k positions at once. Requests with structured outputs
(the grammar's mask moves with every token), repetition/presence/frequency
penalties, or min_tokens still holding decode one token per step, as
without speculation. Logprobs, logit_bias, seeds and every sampling filter
speculate.

How many tokens: num_speculative_tokens, less where max_tokens or the
context would cut them anyway.

Which steps: with more requests running than disable_by_batch_size, none;
otherwise, unless the config says adaptive: false, those the governor
(governor.py) lets speculate, by the decode speed each policy measures at
the batch's size. The engine asks decide() once per step, then proposes.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional, Protocol, Sequence

from tandem.engine.config import ConfigError, EngineConfig, ModelConfig
from tandem.engine.loader import ModelInfo
from tandem.engine.request import Request, RequestStatus
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.engine.spec_decode.governor import SpeculationGovernor
from tandem.engine.spec_decode.ngram_proposer import NgramProposer
from tandem.engine.tensor_parallel import unsplit

log = logging.getLogger(__name__)


class Proposer(Protocol):
    """What proposes draft tokens: NgramProposer, DraftModelProposer."""

    block_bytes: int  # KV bytes it needs beside each of the target's blocks

    def bind(self, num_blocks: int, max_model_len: int, enable_caching: bool) -> None:
        """The target's cache is sized: take as many blocks of one's own, if any."""

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests left the target's cache (finished, aborted, preempted)."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to num_tokens[i] tokens to follow requests[i]'s tokens ([]: none)."""


def speculates(request: Request) -> bool:
    """Whether one forward can verify the request's proposals (module docstring)."""
    p = request.params
    return (p.structured_outputs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and request.num_output_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = 2**31 - 1
        self.governor: Optional[SpeculationGovernor] = SpeculationGovernor() if config.adaptive else None
        self._shadows: list[_ShadowLookup] = []  # shadow lookups not yet checked (shadow())
        # propose() set drafts that the next plan has not taken yet: the engine
        # asks, at that step's start, whether they stay beside a prompt chunk.
        self.drafts_pending = False

    @classmethod
    def create(cls, config: EngineConfig, target: ModelInfo) -> "Speculator":
        """The speculator config.speculative describes; a draft model's weights
        are loaded here, its KV cache once the target's size is known (bind)."""
        spec = config.speculative
        if spec.method == "ngram":
            return cls(spec, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
        # Under tensor parallelism the draft stays whole on rank 0, which alone runs it.
        with unsplit():
            return cls(spec, _load_draft(config, target))

    @property
    def kv_block_bytes(self) -> int:
        """What the proposer's KV costs per target block (a draft model's block; 0 for n-grams)."""
        return self.proposer.block_bytes

    def bind(self, num_blocks: int, max_model_len: int, enable_caching: bool) -> None:
        self.max_model_len = max_model_len
        with unsplit():  # its cache and CUDA graphs: the whole draft's
            self.proposer.bind(num_blocks, max_model_len, enable_caching)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests whose blocks went back (finished, aborted, preempted): their proposer state goes."""
        if request_ids:
            self.proposer.forget(request_ids)

    @property
    def can_probe(self) -> bool:
        """Whether would_propose may run between steps: prompt lookup keeps no
        state a lookup changes and costs microseconds a request; a draft
        model's proposals are its forwards, which move its KV."""
        return isinstance(self.proposer, NgramProposer)

    def decide(self, num_running: int) -> bool:
        """Whether the next step may carry drafts, for a batch of num_running
        requests (the module docstring); the engine proposes only if so."""
        off_above = self.config.disable_by_batch_size
        if off_above is not None and num_running > off_above:
            if self.governor is not None:
                self.governor.forget_decision()
            return False
        return self.governor is None or self.governor.decide(num_running)

    def step_started(self, now: float) -> None:
        """The engine starts a step (time.perf_counter): the governor's clock."""
        if self.governor is not None:
            self.governor.step_started(now)

    def step_ran(self, start: float, plan, num_accepted: int) -> None:
        """The step begun at `start` ran `plan` (a SchedulerOutput) and its
        verified rows accepted num_accepted drafts in all: the governor
        measures it if it only decoded."""
        if self.governor is not None:
            self.governor.step_ran(start, plan.has_no_prompt_chunk, len(plan.sampled) + num_accepted,
                                   verified=bool(plan.num_draft_tokens), rows=len(plan.sampled))
            if self._shadows:
                self.check_shadows()

    def wants_shadow(self) -> bool:
        """Whether the engine should call shadow() for the step just decided
        plain: the governor asks (governor.py), and the proposer can be asked
        without changing anything."""
        return self.governor is not None and self.can_probe and self.governor.wants_shadow()

    def shadow(self, requests: Sequence[Request]) -> None:
        """Ask the proposer what it would propose for `requests` now, without
        proposing; once the tokens that follow are known (check_shadows),
        the governor learns what a speculating step would have emitted."""
        running = [r for r in requests if r.status is RequestStatus.RUNNING]
        if not running or len(self._shadows) >= MAX_SHADOWS:
            return
        chosen, ks = self._chosen(running)
        proposals = self.proposer.propose(chosen, ks) if chosen else []
        pending = [(r, r.num_tokens, d) for r, d in zip(chosen, proposals) if d]
        # A row without drafts emits one token, as a plain step's.
        self._shadows.append(_ShadowLookup(rows=len(running), tokens=len(running) - len(pending),
                                           pending=pending))
        self.check_shadows()

    def check_shadows(self) -> None:
        """Each shadow lookup whose drafts can all be checked now goes to the
        governor: a row emits 1 + the drafts that match what followed, as
        the rejection sampler would accept them, the target's own token after
        them included (governor.py). A request that ended first counts no
        more than the tokens it had; one that went back to the queue waits.
        A lookup not complete after MAX_SHADOW_STEPS checks is dropped."""
        kept = []
        for lookup in self._shadows:
            lookup.checks += 1
            still = []
            for request, at, drafts in lookup.pending:
                followed = request.all_token_ids[at:at + len(drafts)]
                if len(followed) < len(drafts) and not request.is_finished:
                    still.append((request, at, drafts))
                    continue
                matched = 0
                for drafted, came in zip(drafts, followed):
                    if drafted != came:
                        break
                    matched += 1
                emitted = 1 + matched
                if request.is_finished:
                    emitted = min(emitted, max(request.num_tokens - at, 1))
                lookup.tokens += emitted
            lookup.pending = still
            if not still:
                self.governor.shadow_resolved(lookup.tokens, lookup.rows)
            elif lookup.checks < MAX_SHADOW_STEPS:
                kept.append(lookup)
        self._shadows = kept

    def propose(self, requests: Sequence[Request]) -> None:
        """Set spec_token_ids of each running request in `requests` that speculates."""
        chosen, ks = self._chosen(requests)
        if not chosen:
            return
        with unsplit():
            proposals = self.proposer.propose(chosen, ks)
        for request, drafts in zip(chosen, proposals):
            if drafts:
                request.spec_token_ids = drafts
                self.drafts_pending = True

    def keep_drafts_beside_prompt(self, num_requests: int) -> bool:
        """The step about to be scheduled, for about num_requests requests,
        carries a prompt chunk beside the drafts proposed for it: whether
        they stay (the governor's groups of such steps; always without a
        governor)."""
        return self.governor is None or self.governor.decide_beside_prompt(num_requests)

    def would_propose(self, requests: Sequence[Request]) -> bool:
        """Whether propose() would give any of `requests` drafts, setting none
        (can_probe proposers only). Asynchronous scheduling asks it while a
        step's tokens are still on the device: a lookup one token behind
        predicts whether the next one finds drafts."""
        chosen, ks = self._chosen(requests)
        return bool(chosen) and any(self.proposer.propose(chosen, ks))

    def _chosen(self, requests: Sequence[Request]) -> tuple[list[Request], list[int]]:
        """The requests that get proposals, and how many tokens each at most."""
        chosen: list[Request] = []
        ks: list[int] = []
        for request in requests:
            if request.status is not RequestStatus.RUNNING or not speculates(request):
                continue
            # A step emits at most k + 1 tokens, and its k drafts take positions
            # num_tokens .. num_tokens + k - 1.
            k = min(self.k, request.params.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens)
            if k > 0:
                chosen.append(request)
                ks.append(k)
        return chosen, ks


# Shadow lookups in flight at most, and the checks (one a step) before one is dropped.
MAX_SHADOWS = 8
MAX_SHADOW_STEPS = 32


@dataclasses.dataclass
class _ShadowLookup:
    """One shadow lookup (Speculator.shadow): its rows, the tokens counted so
    far, and the drafts not yet checked: (request, position of the first
    draft, drafts)."""

    rows: int
    tokens: int
    pending: list
    checks: int = 0


def _load_draft(config: EngineConfig, target: ModelInfo):
    """The draft model's runner and proposer, with its weights loaded and its
    cache not yet bound. Its tokenizer must be the target's: proposals are ids."""
    from tandem.engine.hub import HubSource
    from tandem.engine.loader import ModelNotFoundError, load_model_info
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.spec_decode.draft_proposer import DraftModelProposer

    spec, mc = config.speculative, config.model
    try:
        info = load_model_info(spec.model, mc.load_format, None, None, None, HubSource(None, mc.download_dir))
    except ModelNotFoundError as exc:
        raise ConfigError(f"--speculative-config: the draft model: {exc}") from None
    _check_same_vocabulary(spec.model, info, mc.model, target)
    # Its own copy of the settings: the target's device, dtype and scheduler
    # limits; no KV transfer or host tier (its KV never leaves the process);
    # two blocks until bind() gives it the target's number.
    draft_config = dataclasses.replace(
        config, model=dataclasses.replace(ModelConfig(), model=spec.model, load_format=mc.load_format,
                                          dtype=mc.dtype, seed=mc.seed, download_dir=mc.download_dir),
        cache=dataclasses.replace(config.cache, num_blocks=2, swap_space_gib=0.0),
        kv_transfer=None, speculative=None)
    runner = ModelRunner(draft_config, info)
    log.info("draft model %s loaded for speculative decoding (%d tokens per step)", info.model_id,
             spec.num_speculative_tokens)
    return DraftModelProposer(runner, min(info.hf_config.vocab_size, target.hf_config.vocab_size),
                              info.max_model_len, config.scheduler.max_num_batched_tokens)


def _check_same_vocabulary(draft_name: str, draft: ModelInfo, target_name: str, target: ModelInfo) -> None:
    problem: Optional[str] = None
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            problem = "its tokenizer's vocabulary differs from the served model's"
    elif draft.hf_config.vocab_size != target.hf_config.vocab_size:
        problem = (f"its vocabulary has {draft.hf_config.vocab_size} tokens, the served model's "
                   f"{target.hf_config.vocab_size}")
    if problem is not None:
        raise ConfigError(f"--speculative-config: the draft model {draft_name!r} cannot draft for "
                          f"{target_name!r}: {problem}; use a draft of the same tokenizer (e.g. a smaller "
                          "model of the same family)")
