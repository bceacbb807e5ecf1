"""One step's plan under a token budget.

Running requests are served before waiting ones (decodes first under FIFO;
SRTF picks the fewest remaining tokens, which are the decodes). A prompt longer
than the remaining budget is chunked. When blocks run out, the lowest-priority
running request is preempted by recompute: its blocks are freed and its
num_computed_tokens drops to zero. There is no per-phase code path: every
request advances num_computed_tokens towards num_tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

from tandem.engine.config import CacheConfig, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.engine.connector.base import KVConnector


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # tokens [start, start + num_new_tokens) are computed this step
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this step reaches the last known token, so its logits are sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    connector_meta: Optional[object] = None
    # Entries that are plain decodes: one token, the request's last known one
    # (so it samples), into a slot it already holds. When every entry is one,
    # input preparation takes its decode path.
    num_plain_decodes: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up in the local cache
    prefix_cache_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, kv: KVCacheManager,
                 connector: Optional["KVConnector"] = None) -> None:
        if config.policy not in ("fifo", "srtf"):
            raise ValueError(f"policy must be 'fifo' or 'srtf', got {config.policy!r}")
        self.config = config
        self.kv = kv
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.staging: list[Request] = []  # two-level SRTF's second-level queue
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ---- bookkeeping -------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.staging)

    def waiting_requests(self) -> Iterable[Request]:
        yield from self.staging
        yield from self.waiting

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of every queue and give its blocks back."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.staging:
            self.staging.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector is not None:
            # Before the blocks go back: a connector may keep some (direct transfer holds).
            self.connector.request_finished(request)
        self.kv.forget(request)
        request.decode_entry = None  # it refers back to the request: no cycle left for the GC
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Optional[Request]:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    # ---- planning ----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "fifo":
            budget = self._schedule_running(self.running, budget, out)
            if not out.preempted:
                self._schedule_waiting_fifo(budget, out)
        else:
            self._schedule_srtf(budget, out)
        if self.connector is not None:
            out.connector_meta = self.connector.build_meta(out)
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _schedule_one_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule a running request, preempting others for blocks; returns tokens used."""
        num_new = self._chunk(request.num_remaining_tokens, budget)
        if num_new <= 0:
            return 0
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._pick_victim(out)
            self._preempt(victim, out)
            if victim is request:
                return 0
        self._emit(request, num_new, out)
        return num_new

    def _schedule_running(self, requests: list[Request], budget: int, out: SchedulerOutput) -> int:
        requests = list(requests)
        # Settled up front: a request's entry depends on its own state alone, and
        # one that is preempted below is skipped.
        fast = self.kv.append_slots(requests)
        scheduled = out.scheduled
        running = RequestStatus.RUNNING
        num_decodes = 0
        for request, ids in zip(requests, fast):
            if budget <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            if ids is None:
                # At large batch the general path is mostly a decode into a new block.
                ids = self.kv.append_block(request)
            if ids is not None:  # a decode: most of a decode step
                start = request.num_computed_tokens
                request.num_computed_tokens = start + 1
                entry = request.decode_entry
                if entry is None:
                    entry = request.decode_entry = ScheduledRequest(request, start, 1, ids)
                else:
                    entry.start = start
                    entry.num_new_tokens = 1
                    entry.block_ids = ids
                scheduled.append(entry)
                budget -= 1
                num_decodes += 1
            else:
                budget -= self._schedule_one_running(request, budget, out)
        out.num_plain_decodes += num_decodes
        return budget

    def _pick_victim(self, out: SchedulerOutput) -> Request:
        scheduled = {s.request.request_id for s in out.scheduled}
        for request in reversed(self.running):
            if request.request_id not in scheduled:
                return request
        raise AssertionError("no preemptible request: the KV cache is too small for one step")

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # recompute from scratch (prefix cache may help)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        """Try to start a waiting request; returns tokens used (0: it did not fit)."""
        if len(self.running) >= self.config.max_num_seqs:
            return 0
        if self.connector is not None and not self.connector.is_ready(request):
            return 0  # its KV is still being fetched
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_external = 0
        if self.connector is not None:
            num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        num_new = self._chunk(request.num_tokens - num_hit_tokens - num_external, budget)
        if num_new <= 0:
            return 0
        if self.kv.allocate_slots(request, num_new, hits, num_external) is None:
            return 0
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens + num_external
        if request.num_preemptions == 0:
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_hit_tokens
            request.num_cached_tokens = num_hit_tokens
            request.num_external_tokens = num_external
        self.running.append(request)
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv.block_ids(request), num_hit_tokens, num_external)
        self._emit(request, num_new, out)
        return num_new

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

    def _emit(self, request: Request, num_new: int, out: SchedulerOutput) -> None:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new  # progress advances when scheduled
        out.scheduled.append(ScheduledRequest(request, start, num_new, self.kv.block_ids(request)))

    def rollback_external(self, scheduled: ScheduledRequest, num_external: int) -> None:
        """A KV load failed: compute those tokens instead. The blocks are already
        allocated for them, so only the plan's start moves back."""
        scheduled.start -= num_external
        scheduled.num_new_tokens += num_external
        scheduled.request.num_external_tokens = 0
