"""The Prometheus metrics of an engine role: gauges and counters polled from
`engine.stats()`, latency histograms from the requests the role handled."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)


@dataclass
class RequestTimer:
    """Per-request timestamps, turned into the latency histograms at the end."""

    arrival: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_output_tokens: int = 0


class EngineMetrics:
    """Exports engine metrics: gauges and counters from polling `engine.stats()`
    (cumulative counters become counter increments of their deltas), latency
    histograms from the requests this service handled."""

    # engine.stats() counter field -> (metric attribute in tandem.services.common.metrics, extra labels)
    COUNTERS = {
        "prefix_cache_queries": ("PREFIX_CACHE_QUERIES", {}),
        "prefix_cache_hits": ("PREFIX_CACHE_HITS", {}),
        "num_preemptions": ("NUM_PREEMPTIONS", {}),
        "num_admissions_deferred": ("KV_ADMISSIONS_DEFERRED", {}),
        "num_admissions_tail": ("KV_ADMISSIONS_TAIL", {}),
        "prompt_tokens_computed": ("PROMPT_TOKENS_BY_SOURCE", {"source": "local_compute"}),
        "prompt_tokens_local_hit": ("PROMPT_TOKENS_BY_SOURCE", {"source": "local_cache_hit"}),
        "prompt_tokens_external": ("PROMPT_TOKENS_BY_SOURCE", {"source": "external_kv_transfer"}),
        "kv_save_bytes": ("KV_TRANSFER_BYTES", {"direction": "save"}),
        "kv_load_bytes": ("KV_TRANSFER_BYTES", {"direction": "load"}),
        "kv_save_blocks": ("KV_TRANSFER_BLOCKS", {"direction": "save"}),
        "kv_load_blocks": ("KV_TRANSFER_BLOCKS", {"direction": "load"}),
        "recompute_fallbacks": ("KV_RECOMPUTE_FALLBACKS", {}),
        "kv_write_wait_seconds": ("KV_STORE_WRITE_WAIT_SECONDS", {}),
        "kv_write_wait_timeouts": ("KV_STORE_WRITE_WAIT_TIMEOUTS", {}),
        "kv_save_blocks_lent": ("KV_STORE_LENT_BLOCKS", {"direction": "save"}),
        "kv_load_blocks_lent": ("KV_STORE_LENT_BLOCKS", {"direction": "load"}),
        "kv_swapped_out_blocks": ("KV_SWAPPED_OUT_BLOCKS", {}),
        "kv_swapped_in_blocks": ("KV_SWAPPED_IN_BLOCKS", {}),
        "kv_host_offloaded_blocks": ("KV_HOST_OFFLOADED_BLOCKS", {}),
        "kv_host_hit_blocks": ("KV_HOST_HIT_BLOCKS", {}),
        "spec_decode_num_drafts": ("SPEC_DECODE_NUM_DRAFTS", {}),
        "spec_decode_num_draft_tokens": ("SPEC_DECODE_NUM_DRAFT_TOKENS", {}),
        "spec_decode_num_accepted_tokens": ("SPEC_DECODE_NUM_ACCEPTED_TOKENS", {}),
        "spec_decode_num_emitted_tokens": ("SPEC_DECODE_NUM_EMITTED_TOKENS", {}),
        "spec_decode_governed_speculate_steps": ("SPEC_DECODE_GOVERNED_STEPS", {"policy": "speculate"}),
        "spec_decode_governed_plain_steps": ("SPEC_DECODE_GOVERNED_STEPS", {"policy": "plain"}),
        "spec_decode_governor_changes": ("SPEC_DECODE_GOVERNOR_CHANGES", {}),
    }

    def __init__(self, engine, role: str) -> None:
        from tandem.services.common import metrics

        self._m = metrics
        self._engine = engine
        self._labels = {"role": role, "model": engine.model_id}
        self._last: dict[str, float] = {}
        # Every series exists from startup at 0, so rate() and alerts see the
        # first increment instead of a series appearing out of nowhere.
        for name, extra in self.COUNTERS.values():
            self._labelled(name, **extra)
        for name in ("REQUESTS_REJECTED", "GENERATION_TOKENS", "PROMPT_TOKENS"):
            self._labelled(name)
        for reason in ("stop", "length", "abort", "error"):
            self._labelled("REQUEST_SUCCESS", finished_reason=reason)

    def _labelled(self, name: str, **extra):
        return getattr(self._m, name).labels(**self._labels, **extra)

    def poll(self) -> None:
        stats = self._engine.stats()
        self._labelled("NUM_REQUESTS_RUNNING").set(stats.num_running)
        self._labelled("NUM_REQUESTS_WAITING").set(stats.num_waiting)
        self._labelled("NUM_WAITING_PROMPT_TOKENS").set(stats.num_waiting_prompt_tokens)
        self._labelled("KV_CACHE_USAGE_PERC").set(stats.kv_cache_usage)
        self._labelled("KV_CACHE_FREE_BLOCKS").set(stats.num_free_blocks)
        self._labelled("KV_CACHE_TOTAL_BLOCKS").set(stats.num_total_blocks)
        self._labelled("KV_HELD_BLOCKS").set(stats.num_held_blocks)
        for field, (name, extra) in self.COUNTERS.items():
            self._add(field, getattr(stats, field), name, extra)
        for phase, seconds in stats.kv_phase_seconds.items():
            self._add(f"phase_seconds:{phase}", seconds, "KV_TRANSFER_PHASE_SECONDS", {"phase": phase})
        for phase, count in stats.kv_phase_counts.items():
            self._add(f"phase_count:{phase}", count, "KV_TRANSFER_PHASES", {"phase": phase})
        # Transfer time is cumulative seconds in stats; observe each poll's share.
        for direction in ("save", "load"):
            field = f"kv_{direction}_seconds"
            value = getattr(stats, field)
            delta = value - self._last.get(field, 0.0)
            self._last[field] = value
            if delta > 0:
                self._labelled("KV_TRANSFER_SECONDS", direction=direction).observe(delta)

    def _add(self, field: str, value: float, name: str, extra: dict) -> None:
        delta = value - self._last.get(field, 0)
        self._last[field] = value
        if delta > 0:
            self._labelled(name, **extra).inc(delta)

    async def poll_forever(self, interval_s: float = 0.5) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # metrics must never take the service down
                log.exception("polling engine stats failed")
            await asyncio.sleep(interval_s)

    def rejected(self) -> None:
        self._labelled("REQUESTS_REJECTED").inc()

    def start_request(self) -> RequestTimer:
        return RequestTimer(arrival=time.monotonic())

    def on_tokens(self, timer: RequestTimer, n: int) -> None:
        now = time.monotonic()
        if n <= 0:
            return
        if timer.first_token is None:
            timer.first_token = now
            self._labelled("TIME_TO_FIRST_TOKEN").observe(now - timer.arrival)
        elif timer.last_token is not None:
            self._labelled("INTER_TOKEN_LATENCY").observe((now - timer.last_token) / n)
        timer.last_token = now
        timer.num_output_tokens += n
        self._labelled("GENERATION_TOKENS").inc(n)

    def finish_request(self, timer: RequestTimer, finish_reason: Optional[str],
                       num_prompt_tokens: int) -> None:
        now = time.monotonic()
        self._labelled("E2E_REQUEST_LATENCY").observe(now - timer.arrival)
        self._labelled("PROMPT_TOKENS").inc(num_prompt_tokens)
        if timer.first_token is not None:
            self._labelled("REQUEST_QUEUE_TIME").observe(timer.first_token - timer.arrival)
        if timer.first_token is not None and timer.num_output_tokens > 1:
            self._labelled("TIME_PER_OUTPUT_TOKEN").observe(
                (now - timer.first_token) / (timer.num_output_tokens - 1))
        if finish_reason:
            self._labelled("REQUEST_SUCCESS", finished_reason=finish_reason).inc()
