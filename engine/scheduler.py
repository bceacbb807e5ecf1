"""One step's plan under a token budget, and the update after the step.

Running requests are served before waiting ones (decodes first under FIFO;
SRTF picks the fewest remaining tokens, which are the decodes). A prompt longer
than the remaining budget is chunked. When blocks run out, the lowest-priority
running request is preempted: its blocks are freed and its
num_computed_tokens drops to zero; with the host KV tier on (kv_swapper.py)
its KV is swapped out to host memory and swapped back in at re-admission,
otherwise it is recomputed. There is no per-phase code path: every request
advances num_computed_tokens towards num_tokens.

The update step takes the sampled tokens and applies the stop rules; a
finished request is freed by one call, finish(), which also asks the KV
connector whether to hold its blocks for a consumer (the scheduler's holds,
kv_holds.py).

Speculative decoding changes only the numbers: a decode that carries k
proposed tokens (request.spec_token_ids) computes 1 + k tokens, and its
update (update_verified) takes the accepted ones plus the target's own token
and moves num_computed_tokens back over the rejected ones, whose KV slots the
next step writes again. Blocks are named only within the request's known
tokens, so no block hash ever names a rejected token.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from tandem.engine.admission import KVProjection, OutputLengthEstimate, steps_left, tail_fits
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from tandem.engine.kv_holds import KVHolds
from tandem.engine.outputs import NO_LOGPROBS, RequestOutput, request_output
from tandem.engine.plan import PENDING_TOKEN, SchedulerOutput
from tandem.engine.request import NO_DRAFTS, Request, RequestFailedError, RequestStatus, TokenLogprob

if TYPE_CHECKING:
    from tandem.engine.connector.base import KVConnector
    from tandem.engine.kv_swapper import KVSwapper

log = logging.getLogger(__name__)

NO_BLOCK_IDS: list[int] = []  # an entry that got no new block (shared, never mutated)
# Finished by the stop rules or max_tokens: their output lengths teach admission.py.
_FINISHED_ON_ITS_OWN = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up in the local cache
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Admission "reserve": times a waiting request stayed waiting because the
    # blocks projected for it and those running would not fit (admission.py).
    num_admissions_deferred: int = 0
    # ... and times one was admitted past the projection as part of a short tail.
    num_admissions_tail: int = 0
    # Where prompt tokens came from (requests never preempted): computed here,
    # local prefix-cache hits, the KV connector.
    prompt_tokens_computed: int = 0
    prompt_tokens_local_hit: int = 0
    prompt_tokens_external: int = 0
    generation_tokens: int = 0  # tokens sampled here
    # Speculative decoding: decodes that carried draft tokens, the draft
    # tokens verified, those accepted, and the tokens those decodes added to
    # their requests (accepted + the target's own, less what a stop cut).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 connector: Optional["KVConnector"] = None, max_model_len: int = 2**31 - 1,
                 kv_hold_timeout_s: float = 30.0, swapper: Optional["KVSwapper"] = None) -> None:
        if config.policy not in ("fifo", "srtf"):
            raise ValueError(f"policy must be 'fifo' or 'srtf', got {config.policy!r}")
        if config.admission not in ("reserve", "greedy"):
            raise ValueError(f"admission must be 'reserve' or 'greedy', got {config.admission!r}")
        if config.admission_overcommit < 0:
            raise ValueError(f"admission_overcommit must be 0 or more, got {config.admission_overcommit}")
        if config.admission_tail < 0:
            raise ValueError(f"admission_tail must be 0 or more, got {config.admission_tail}")
        self.config = config
        self.kv = kv
        self.connector = connector
        self.swapper = swapper  # the host KV tier's scheduler side, or None (preemption recomputes)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.staging: list[Request] = []  # two-level SRTF's second-level queue
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.requests: dict[str, Request] = {}
        self.holds = KVHolds(kv, connector, kv_hold_timeout_s)
        self.stats = SchedulerStats()
        # admission "reserve" (admission.py): the expected output lengths, and
        # the running requests' projected blocks, made once a plan at its
        # first admission (None: not yet this plan).
        self.output_estimate = OutputLengthEstimate() if config.admission == "reserve" else None
        self._projection: Optional[KVProjection] = None
        self._tail: Optional[bool] = None  # this plan's verdict on the waiting queue as a tail
        self._cache_blocks = 0  # with the projection: the blocks free and running, this plan
        self._freed: list[str] = []  # requests whose blocks went back since the last plan
        self._sampling: list[Request] = []  # the last plan's sampled entries' requests, in order
        # Speculative decoding: the last plan's draft tokens by entry index, and
        # aligned with _sampling (empty when no entry carries any).
        self._entry_drafts: dict[int, list[int]] = {}
        self._drafts: list[list[int]] = []
        # Tokens taken whose text and outputs wait for take_text (update_verified's defer_text).
        self._untexted: list[tuple[Request, list[int], list, Optional[RequestStatus]]] = []

    # ---- bookkeeping -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.holds.expire()  # also here: an idle engine steps only when requests arrive
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._untexted)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.staging)

    def has_prompt_work(self) -> bool:
        """Whether the next plan is likely to carry a prompt chunk: a request
        waits, or a running one has part of its prompt still to compute
        (speculative decoding measures such steps apart)."""
        return bool(self.waiting or self.staging) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in self.running)

    def num_to_run(self) -> int:
        """How many requests the next plan can carry: the running ones and
        as many waiting ones as max_num_seqs leaves room for (before the
        token budget and the KV blocks have their say)."""
        return min(self.config.max_num_seqs, len(self.running) + self.num_waiting)

    def drop_drafts(self) -> None:
        """The running requests' proposals go unused: the next plan decodes
        them plainly."""
        for r in self.running:
            r.spec_token_ids = NO_DRAFTS

    def waiting_requests(self) -> Iterable[Request]:
        yield from self.staging
        yield from self.waiting

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The one call that lets a request go: out of every queue, its blocks
        back (or held for a consumer when the connector asks), its row in the
        runner dropped at the next plan."""
        request.status = status
        request.spec_token_ids = NO_DRAFTS
        if self.output_estimate is not None and status in _FINISHED_ON_ITS_OWN:
            self.output_estimate.observe(request.num_output_tokens)
        if request in self.running:
            self.running.remove(request)
        elif request in self.staging:
            self.staging.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector is not None:
            hold, params = self.connector.request_finished(request, request.block_ids)
            request.kv_transfer_params.update(params)
            if hold > 0:
                self.holds.hold(request, hold, params)
        if request.host_slots:
            self.swapper.release(request)  # swapped out, and leaving before it resumed
        self.kv.free(request)
        self._freed.append(request.request_id)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Optional[Request]:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def release_hold(self, request_id: str) -> bool:
        """The consumer of a finished request's blocks has them: let them go."""
        return self.holds.release(request_id)

    @property
    def num_held_blocks(self) -> int:
        return self.holds.num_blocks

    # ---- planning ----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.holds.expire()
        out = SchedulerOutput()
        self._projection = None
        self._tail = None
        self._sampling = []
        self._entry_drafts = {}
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "fifo":
            budget = self._schedule_running(self.running, budget, out)
            if not out.preempted_request_ids:
                self._schedule_waiting_fifo(budget, out)
        else:
            self._schedule_srtf(budget, out)
        out.freed_request_ids, self._freed = self._freed, []
        self._drafts = []
        if self._entry_drafts:
            self._drafts = [self._entry_drafts.get(e, NO_DRAFTS) for e in out.sampled]
            out.num_draft_tokens = [len(d) for d in self._drafts]
        if self.swapper is not None:
            self.swapper.flush(out)
        if self.connector is not None:
            out.connector_meta = self.connector.build_meta(out, self.requests)
        return out

    @property
    def sampling_requests(self) -> list[Request]:
        """The requests of the last plan's sampled entries, in order."""
        return self._sampling

    @property
    def sampling_drafts(self) -> list[list[int]]:
        """The draft tokens each of sampling_requests carries in the last plan
        (aligned with it), or [] when none carries any."""
        return self._drafts

    def _chunk(self, remaining: int, budget: int) -> int:
        n = remaining if remaining < budget else budget
        threshold = self.config.long_prefill_token_threshold
        return n if threshold <= 0 or n <= threshold else threshold

    def _schedule_running(self, requests: list[Request], budget: int, out: SchedulerOutput) -> int:
        """Schedule running requests in order, preempting later ones for blocks;
        returns the budget left."""
        allocate = self.kv.allocate_slots
        running = RequestStatus.RUNNING
        threshold = self.config.long_prefill_token_threshold
        # Most entries of a step are decodes; they are added here, inline,
        # instead of through _emit (a quarter of schedule()'s time at batch 256).
        request_ids, starts, counts = out.request_ids, out.num_computed_tokens, out.num_new_tokens
        new_block_ids, token_ids, sampled, sampling = out.new_block_ids, out.token_ids, out.sampled, self._sampling
        for request in list(requests):
            if budget <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            tokens = request.all_token_ids
            start = request.num_computed_tokens
            pending = request.pending_token_row >= 0  # its last token is still on the device
            if pending and request.ends_with_pending_token(self.max_model_len):
                continue  # finished once that token arrives: nothing to compute after it
            known = len(tokens) + pending
            num_new = known - start  # what _chunk decides, inline: this runs for every request
            if num_new > budget:
                num_new = budget
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new <= 0:
                continue
            drafts = request.spec_token_ids
            if drafts is not NO_DRAFTS:
                request.spec_token_ids = NO_DRAFTS
                # A decode's proposals ride along as far as the budget and the
                # context allow. They never preempt anyone: without blocks for
                # them the request decodes its one token.
                room = min(budget - 1, self.max_model_len - len(tokens))
                if room > 0 and len(tokens) - start == 1:
                    drafts = drafts[:room]
                    new_blocks = allocate(request, 1 + len(drafts))
                    if new_blocks is not None:
                        budget -= 1 + len(drafts)
                        self._emit(request, 1 + len(drafts), new_blocks, out, drafts)
                        continue
            new_blocks = allocate(request, num_new)
            while new_blocks is None:
                victim = self._pick_victim(out)
                self._preempt(victim, out)
                if victim is request:
                    break
                new_blocks = allocate(request, num_new)
            if new_blocks is None:
                continue
            budget -= num_new
            if new_blocks is NO_NEW_BLOCKS and start + 1 == known and start >= request.num_prompt_tokens:
                # What _emit does for a decode into a slot the request holds.
                request.num_computed_tokens = start + 1
                if pending:
                    out.pending_entries.append(len(request_ids))
                    out.pending_rows.append(request.pending_token_row)
                    token_ids.append(PENDING_TOKEN)
                else:
                    token_ids.append(tokens[start])
                sampled.append(len(request_ids))
                request_ids.append(request.request_id)
                starts.append(start)
                counts.append(1)
                new_block_ids.append(NO_BLOCK_IDS)
                sampling.append(request)
            else:
                self._emit(request, num_new, new_blocks, out)
        return budget

    def _pick_victim(self, out: SchedulerOutput) -> Request:
        scheduled = set(out.request_ids)
        for request in reversed(self.running):
            if request.request_id not in scheduled:
                return request
        raise AssertionError("no preemptible request: the KV cache is too small for one step")

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        if self.swapper is not None:
            self.swapper.swap_out(request)  # False: no room on the host, it recomputes
        self.kv.free(request)
        self._freed.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # none on the device (prefix cache or host tier may help)
        request.spec_token_ids = NO_DRAFTS
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Try to start a waiting request; returns tokens used (0: it did not fit)."""
        if len(self.running) >= self.config.max_num_seqs:
            return 0
        if request.pending_token_row >= 0:
            return 0  # preempted while its last token was in flight: back once that token is here
        if self.connector is not None and not self.connector.is_ready(request):
            return 0  # its KV is still being fetched
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        host = self.swapper.restorable(request, hits) if self.swapper is not None else None
        num_host = host.num_tokens if host is not None else 0  # swapped in, into fresh blocks
        num_external = 0
        if self.connector is not None:
            # The tiers in order: the device's prefix cache, the host tier, then
            # what lies outside (the store, a prefill): the connector supplies
            # only blocks past the first two.
            num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens + num_host)
        num_new = self._chunk(request.num_tokens - num_hit_tokens - num_host - num_external, budget)
        if num_new <= 0:
            return 0
        if self.output_estimate is not None and self.running and not self._fits_projection(request, hits):
            self.stats.num_admissions_deferred += 1
            return 0
        added = self.kv.allocate_slots(request, num_new, hits, num_host + num_external)
        if added is None:
            return 0
        if host is not None:
            self.swapper.restore(request, host)
        num_hit_tokens += num_host  # local either way: the device cache or the host tier
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens + num_external
        if request.num_preemptions == 0:
            stats = self.stats
            stats.prefix_cache_queries += request.num_tokens
            stats.prefix_cache_hits += num_hit_tokens
            stats.prompt_tokens_local_hit += num_hit_tokens
            stats.prompt_tokens_external += num_external
            request.num_cached_tokens = num_hit_tokens
            request.num_external_tokens = num_external
        self.running.append(request)
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, request.block_ids, num_hit_tokens, num_external)
        self._emit(request, num_new, added, out)
        return num_new

    def _fits_projection(self, request: Request, hits: list) -> bool:
        """Admission "reserve": whether the running requests' projected blocks
        (admission.py), with this request's, stay within the cache and the
        overcommit allowed beyond it, or within the tail's share more where
        everything still waiting is a short tail; if so the request joins the
        projection. Shared prefix blocks it hits take nothing more."""
        bs = self.kv.block_size
        projection = self._projection
        if projection is None:
            self._cache_blocks = self.kv.pool.num_free_blocks + sum(len(r.block_ids) for r in self.running)
            capacity = self._cache_blocks * (1.0 + self.config.admission_overcommit)
            projection = self._projection = KVProjection(self.running, self.output_estimate, bs, capacity)
        finish = steps_left(request, self.output_estimate.expected_output(request))
        tokens = request.num_tokens - len(hits) * bs
        if projection.admit(tokens, finish):
            return True
        share = self.config.admission_tail
        if self._tail is None:  # at the plan's first refusal: admissions only shrink the queue after it
            queue = itertools.chain(self.staging, self.waiting)  # --policy srtf stages some of it
            self._tail = share > 0 and tail_fits(queue, self.output_estimate, share * self._cache_blocks * bs)
            if self._tail:
                projection.capacity += share * self._cache_blocks
        if self._tail and projection.admit(tokens, finish):
            self.stats.num_admissions_tail += 1
            return True
        return False

    def _schedule_waiting_fifo(self, budget: int, out: SchedulerOutput) -> None:
        # Requests whose KV is still being fetched step aside (in order) for the
        # ones behind them; otherwise the head blocks the rest.
        fetching: list[Request] = []
        while self.waiting and budget > 0:
            if self.connector is not None and not self.connector.is_ready(self.waiting[0]):
                fetching.append(self.waiting.popleft())
                continue
            used = self._admit(self.waiting[0], budget, out)
            if used == 0:
                break
            self.waiting.popleft()
            budget -= used
        self.waiting.extendleft(reversed(fetching))  # back at the head, in their order

    def _schedule_srtf(self, budget: int, out: SchedulerOutput) -> None:
        """Two-level scheduling (thesis 4.5.3): FIFO from waiting into a small
        staging queue, refilled only once it is empty; SRTF over running and staged."""
        if not self.staging:
            while self.waiting and len(self.staging) < self.config.staging_queue_size:
                self.staging.append(self.waiting.popleft())
        # Preempted requests wait at the head of `waiting`; they re-enter via staging.
        running = sorted(self.running, key=lambda r: r.num_remaining_tokens)  # stable: arrival order on ties
        skipped: set[str] = set()
        i = 0
        while budget > 0:
            while i < len(running) and running[i].status is not RequestStatus.RUNNING:
                i += 1
            staged = [r for r in self.staging if r.request_id not in skipped]
            best_staged = min(staged, key=self._staged_remaining, default=None)
            best_running = running[i] if i < len(running) else None
            if best_running is None and best_staged is None:
                break
            if best_staged is None or (best_running is not None and
                                       best_running.num_remaining_tokens <= self._staged_remaining(best_staged)):
                budget = self._schedule_running([best_running], budget, out)
                i += 1
            else:
                used = self._admit(best_staged, budget, out)
                if used == 0:
                    skipped.add(best_staged.request_id)
                else:
                    self.staging.remove(best_staged)
                    budget -= used

    def _staged_remaining(self, request: Request) -> int:
        # Refreshed on every pick: scheduling one request can create cache hits for another.
        _, num_hit_tokens = self.kv.get_computed_blocks(request)
        return request.num_tokens - num_hit_tokens

    def _emit(self, request: Request, num_new: int, new_blocks: list, out: SchedulerOutput,
              drafts: list[int] = NO_DRAFTS) -> None:
        """Add the entry: `request` computes num_new tokens this step; progress
        advances when scheduled. drafts: a decode's proposed tokens, its last
        len(drafts) of num_new (verified in the update step)."""
        start = request.num_computed_tokens
        end = start + num_new
        request.num_computed_tokens = end
        out.request_ids.append(request.request_id)
        out.num_computed_tokens.append(start)
        out.num_new_tokens.append(num_new)
        out.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else NO_BLOCK_IDS)
        tokens = request.all_token_ids
        if drafts:  # a decode: its last known token, then the proposals
            entry = len(out.request_ids) - 1
            out.token_ids.append(tokens[start])
            out.token_ids.extend(drafts)
            self._entry_drafts[entry] = drafts
            out.sampled.append(entry)
            self._sampling.append(request)
            return
        out.token_ids.extend(self._entry_tokens(request, start, end))
        if end > len(tokens):  # ends with the token in flight
            out.pending_entries.append(len(out.request_ids) - 1)
            out.pending_rows.append(request.pending_token_row)
        if end == len(tokens) + request.num_pending_tokens:  # reaches its last token: its logits are sampled
            out.sampled.append(len(out.request_ids) - 1)
            self._sampling.append(request)
        prompt_end = request.num_prompt_tokens
        if start < prompt_end and request.num_preemptions == 0:
            self.stats.prompt_tokens_computed += min(end, prompt_end) - start

    def rollback_external(self, plan: SchedulerOutput, failed: set[str]) -> None:
        """A KV load failed for these requests: compute the tokens it was to
        bring instead. Their blocks are already allocated for them, so only the
        plan's starts (and its token list) move back."""
        tokens: list[int] = []
        for i, request_id in enumerate(plan.request_ids):
            request = self.requests[request_id]
            start, num_new = plan.num_computed_tokens[i], plan.num_new_tokens[i]
            if request_id in failed and request.num_external_tokens:
                moved = request.num_external_tokens
                start, num_new = start - moved, num_new + moved
                plan.num_computed_tokens[i], plan.num_new_tokens[i] = start, num_new
                if request.num_preemptions == 0:
                    self.stats.prompt_tokens_external -= moved
                    self.stats.prompt_tokens_computed += moved
                request.num_external_tokens = 0
            drafts = self._entry_drafts.get(i, NO_DRAFTS)
            tokens.extend(self._entry_tokens(request, start, start + num_new - len(drafts)))
            tokens.extend(drafts)
        plan.token_ids = tokens

    @staticmethod
    def _entry_tokens(request: Request, start: int, end: int) -> list[int]:
        """The input ids of tokens [start, end) of the request: the known ones,
        and PENDING_TOKEN for the one in flight (the last, when end passes them)."""
        tokens = request.all_token_ids
        if end <= len(tokens):
            return [tokens[start]] if end == start + 1 else tokens[start:end]
        return [*tokens[start:], PENDING_TOKEN]

    # ---- the update step ---------------------------------------------
    def update(self, token_ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprob]],
               errors: dict[int, RequestFailedError],
               requests: Optional[Sequence[Request]] = None) -> list[RequestOutput]:
        """Take the tokens sampled for the last plan's sampled entries (in the
        order of sampling_requests; or for `requests`, an earlier plan's, when
        its tokens arrive a step late: asynchronous scheduling): stop rules,
        text, outputs; finished requests are let go. errors[i]: sampling
        failed for entry i's request, which fails alone. A request that ended
        meanwhile (aborted, or stopped by its token of the step before) takes
        nothing."""
        outputs: list[RequestOutput] = []
        if requests is None:
            requests = self._sampling
            self._sampling = []
        for i, (request, token, logprob) in enumerate(zip(requests, token_ids, logprobs)):
            request.pending_token_row = -1
            if request.is_finished:
                continue
            error = errors.get(i)
            if error is None:
                self.stats.generation_tokens += 1
                try:
                    outputs.append(self._take_token(request, token, logprob))
                    continue
                except Exception as exc:  # detokenizing or a stop rule broke on this request alone
                    log.exception("request %s failed after sampling", request.request_id)
                    error = RequestFailedError(f"the engine failed this request: {exc!r}",
                                               caused_by_request=False)
            outputs.append(self.fail(request, error))
        return outputs

    def update_verified(self, token_ids: Sequence[Sequence[int]],
                        logprobs: Sequence[Sequence[Optional[TokenLogprob]]], num_accepted: Sequence[int],
                        errors: dict[int, RequestFailedError], defer_text: bool = False) -> list[RequestOutput]:
        """update() for a plan whose entries carry draft tokens: entry i of
        sampling_requests takes token_ids[i] (its num_accepted[i] accepted
        drafts, then the target's own token; one token without drafts) until
        a stop rule ends it. defer_text: a request whose text cannot stop it
        (no stop strings) takes its tokens under the stop rules on tokens
        alone; their text and its output wait for take_text, which the engine
        calls while the next step runs (detokenizing some 300 tokens a step
        at batch 64 is about half a millisecond of host)."""
        outputs: list[RequestOutput] = []
        stats = self.stats
        for i, (request, drafts) in enumerate(zip(self._sampling, self._drafts)):
            error = errors.get(i)
            accepted = num_accepted[i] if error is None else 0
            # The rejected drafts' KV is not the sequence's: progress moves back
            # to the accepted tokens, and the next step writes those slots again.
            request.num_computed_tokens -= len(drafts) - accepted
            if error is None:
                try:
                    detok = request.detokenizer
                    if defer_text and (detok is None or not detok.stop):
                        taken = self._take_tokens_untexted(request, token_ids[i], logprobs[i])
                    else:
                        out = self._take_tokens(request, token_ids[i], logprobs[i])
                        outputs.append(out)
                        taken = out.new_token_ids
                    stats.generation_tokens += len(taken)
                    if drafts:
                        stats.spec_num_drafts += 1
                        stats.spec_num_draft_tokens += len(drafts)
                        stats.spec_num_accepted_tokens += accepted
                        stats.spec_num_emitted_tokens += len(taken)
                    continue
                except Exception as exc:  # detokenizing or a stop rule broke on this request alone
                    log.exception("request %s failed after sampling", request.request_id)
                    error = RequestFailedError(f"the engine failed this request: {exc!r}",
                                               caused_by_request=False)
            outputs.append(self.fail(request, error))
        self._sampling = []
        self._drafts = []
        return outputs

    def _take_tokens(self, request: Request, token_ids: Sequence[int],
                     logprobs: Sequence[Optional[TokenLogprob]]) -> RequestOutput:
        """Take tokens in order until a stop rule ends the request (the rest are cut)."""
        taken, taken_logprobs, status = self._take_run(request, token_ids, logprobs, detokenize=True)
        out = self._run_output(request, taken, taken_logprobs, status)
        if status is not None:
            self.finish(request, status)
        return out

    @staticmethod
    def _run_output(request: Request, taken: list[int], logprobs: list[TokenLogprob],
                    status: Optional[RequestStatus]) -> RequestOutput:
        """The output of a run of tokens whose text the detokenizer has taken."""
        detok = request.detokenizer
        text = detok.delta(status is not None) if detok is not None else ""
        return request_output(request, taken, text, logprobs or NO_LOGPROBS, status)

    def _take_tokens_untexted(self, request: Request, token_ids: Sequence[int],
                              logprobs: Sequence[Optional[TokenLogprob]]) -> list[int]:
        """_take_tokens without the text (the request has no stop strings, so
        its text stops nothing): the tokens taken, queued for take_text."""
        taken, taken_logprobs, status = self._take_run(request, token_ids, logprobs, detokenize=False)
        self._untexted.append((request, taken, taken_logprobs, status))
        if status is not None:
            self.finish(request, status)
        return taken

    def _take_run(self, request: Request, token_ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprob]],
                  detokenize: bool) -> tuple[list[int], list[TokenLogprob], Optional[RequestStatus]]:
        """The stop rules over a run of tokens: those taken (up to the first
        that ends the request), their logprobs, and the finished status."""
        taken: list[int] = []
        taken_logprobs: list[TokenLogprob] = []
        status = None
        for token, logprob in zip(token_ids, logprobs):
            status = request.take_token(token, logprob, self.max_model_len, detokenize)
            taken.append(token)
            if logprob is not None:
                taken_logprobs.append(logprob)
            if status is not None:
                break
        if request.num_computed_tokens > request.num_tokens:
            # A stop inside the accepted run: KV past the last token taken is not the sequence's.
            request.num_computed_tokens = request.num_tokens
        return taken, taken_logprobs, status

    def take_text(self) -> list[RequestOutput]:
        """The outputs of the tokens update_verified took without their text:
        detokenized now, in the order taken. A request aborted since gets none."""
        outputs: list[RequestOutput] = []
        untexted, self._untexted = self._untexted, []
        for request, taken, logprobs, status in untexted:
            if status is None and request.status is RequestStatus.FINISHED_ABORTED:
                continue
            detok = request.detokenizer
            if detok is not None:
                for token in taken:
                    detok.add(token)
                if status is not None:
                    detok.finish()
            try:
                outputs.append(self._run_output(request, taken, logprobs, status))
            except Exception as exc:  # building this request's output broke on it alone
                log.exception("request %s failed building its output", request.request_id)
                outputs.append(self.fail(request, RequestFailedError(
                    f"the engine failed this request: {exc!r}", caused_by_request=False)))
        return outputs

    def _take_token(self, request: Request, token: int, logprob: Optional[TokenLogprob]) -> RequestOutput:
        status = request.take_token(token, logprob, self.max_model_len)
        detok = request.detokenizer
        text = detok.delta(status is not None) if detok is not None else ""
        out = request_output(request, [token], text, NO_LOGPROBS if logprob is None else [logprob], status)
        if status is not None:
            self.finish(request, status)
        return out

    def fail(self, request: Request, error: RequestFailedError) -> RequestOutput:
        """Finish one request with an error; its blocks go back, the engine steps on."""
        log.warning("request %s failed: %s", request.request_id, error)
        if not request.is_finished:
            self.finish(request, RequestStatus.FINISHED_ERROR)
        out = request_output(request, [], "", [], RequestStatus.FINISHED_ERROR)
        out.error = error
        return out
