"""What one benchmark run measured: per-request records and their summary.

Definitions (the ones vLLM's serving benchmark uses, so numbers compare):

- TTFT: from sending the request to the first chunk that carries text.
- ITL: the gaps between consecutive text chunks, pooled over all requests.
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1): the first token is
  excluded because its time is TTFT. Undefined for one-token outputs.
- E2E: from sending the request to the end of its stream.
- goodput: completed requests per second that met every SLO given
  (TTFT <= ttft, TPOT <= tpot, E2E <= e2e; a one-token answer has no TPOT and
  meets any TPOT SLO).

Failed requests count as failed and never enter latency statistics or token
throughput. Times in records are seconds; the summary reports milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass
class RequestRecord:
    index: int
    prompt_len: int  # words the dataset put in the prompt
    expected_output_len: int  # max_tokens asked for
    start_s: float = 0.0  # when it was sent, seconds after the benchmark started
    end_s: float = 0.0  # when it finished, successful or not, seconds after the benchmark started
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the server's usage report; prompt_len when it sent none
    output_tokens: int = 0  # from the usage report; number of text chunks when none
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks
    group: int = -1
    turn: int = 0

    @property
    def tpot_s(self) -> Optional[float]:
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def token_times_s(self) -> list[float]:
        """Arrival of each text chunk, seconds after the benchmark started."""
        if self.ttft_s is None:
            return []
        t = self.start_s + self.ttft_s
        times = [t]
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times

    def to_json(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds. All None when there was no sample."""

    mean: Optional[float]
    p50: Optional[float]
    p90: Optional[float]
    p99: Optional[float]
    count: int

    @staticmethod
    def of(seconds: list[float]) -> "LatencyStats":
        if not seconds:
            return LatencyStats(None, None, None, None, 0)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
        return LatencyStats(float(ms.mean()), p50, p90, p99, len(ms))


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    input_token_throughput: float  # prompt tokens of completed requests / s
    output_token_throughput: float
    total_token_throughput: float
    goodput: Optional[float]  # requests / s meeting all SLOs; None when no SLO was given
    good_requests: Optional[int]
    slo_attainment: Optional[float]  # good / all sent (failed included); None when no SLO was given
    slos_ms: dict[str, float]
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats

    def to_json(self) -> dict:
        return asdict(self)


def parse_slos(items: Optional[list[str]]) -> dict[str, float]:
    """`["ttft:1000", "tpot:50"]` -> {"ttft": 1000.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = {"e2el": "e2e"}.get(key.strip().lower(), key.strip().lower())
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in SLO_KEYS or not ms > 0 or math.isinf(ms):
            raise ValueError(f"bad --goodput item {item!r}: write KEY:MILLISECONDS with KEY one of "
                             f"{', '.join(SLO_KEYS)} and a positive number, e.g. ttft:1000 tpot:50")
        slos[key] = ms
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not record.success:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    for key, limit in slos_ms.items():
        value = values[key]
        if value is None:
            if key == "tpot":  # one-token answer: no time per output token to miss
                continue
            return False
        if value * 1000.0 > limit:
            return False
    return True


def summarize(records: list[RequestRecord], duration_s: float, slos_ms: Optional[dict[str, float]] = None) -> Summary:
    slos_ms = dict(slos_ms or {})
    ok = [r for r in records if r.success]
    duration = max(duration_s, 1e-9)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if meets_slos(r, slos_ms)) if slos_ms else None
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration,
        input_token_throughput=prompt_tokens / duration,
        output_token_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        goodput=None if good is None else good / duration,
        good_requests=good,
        slo_attainment=None if good is None else good / max(len(records), 1),
        slos_ms=slos_ms,
        ttft_ms=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=LatencyStats.of([t for t in (r.tpot_s for r in ok) if t is not None]),
        itl_ms=LatencyStats.of([g for r in ok for g in r.itl_s]),
        e2e_ms=LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
    )
