"""The router's metrics (role="router"): requests by status, routing
decisions, skipped prefills, requests in flight and client-side latencies.
The metric objects are defined once in tandem.services.common.metrics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional


# The statuses a client commonly gets: HTTP codes from the gateway, gRPC code
# names from the public gRPC API.
INITIAL_STATUSES = ("200", "400", "401", "404", "408", "413", "429", "499", "500", "502", "503",
                    "504", "OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED",
                    "RESOURCE_EXHAUSTED", "CANCELLED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL")


class RouterTelemetry:
    def __init__(self, model: str) -> None:
        from tandem.services.common import metrics

        self._m = metrics
        self._labels = {"role": "router", "model": model}
        self.in_flight = 0  # requests started and not finished; the gateway's back-pressure limit reads it
        # Series exist from startup at 0 (rate() and alerts see the first increment).
        for status in INITIAL_STATUSES:
            self._labelled("ROUTER_REQUESTS", status=status)
        self._labelled("ROUTER_PREFILL_SKIPPED")
        self._labelled("ROUTER_REQUESTS_IN_FLIGHT")
        for role in ("prefill", "decode"):
            self._labelled("ROUTER_HEALTHY_INSTANCES", target_role=role)
            for outcome in ("retried", "failed"):
                self._labelled("ROUTER_INSTANCE_ERRORS", target_role=role, outcome=outcome)

    def _labelled(self, name: str, **extra):
        return getattr(self._m, name).labels(**self._labels, **extra)

    def backend_failed(self, target_role: str, instance: str) -> None:
        self._labelled("ROUTER_BACKEND_FAILURES", target_role=target_role, backend=instance).inc()

    def instance_error(self, target_role: str, retried: bool) -> None:
        self._labelled("ROUTER_INSTANCE_ERRORS", target_role=target_role,
                       outcome="retried" if retried else "failed").inc()

    def healthy_instances(self, target_role: str, count: int) -> None:
        self._labelled("ROUTER_HEALTHY_INSTANCES", target_role=target_role).set(count)

    def refused(self, status: str) -> None:
        """A request answered before it started: no key, router full, a body too
        large, too slow or never finished."""
        self._labelled("ROUTER_REQUESTS", status=status).inc()

    def routed(self, target_role: str, instance: str) -> None:
        self._labelled("ROUTER_ROUTING_DECISIONS", target_role=target_role, backend=instance).inc()

    def prefill_skipped(self) -> None:
        self._labelled("ROUTER_PREFILL_SKIPPED").inc()

    def start(self) -> "RequestClock":
        self.in_flight += 1
        self._labelled("ROUTER_REQUESTS_IN_FLIGHT").inc()
        return RequestClock(self)

    def _finish(self, clock: "RequestClock", status: str) -> None:
        self.in_flight -= 1
        self._labelled("ROUTER_REQUESTS_IN_FLIGHT").dec()
        self._labelled("ROUTER_REQUESTS", status=status).inc()
        self._labelled("ROUTER_E2E_REQUEST_LATENCY").observe(time.monotonic() - clock.arrival)


@dataclass
class RequestClock:
    """Times one client request; finish() exactly once (idempotent)."""

    telemetry: RouterTelemetry
    arrival: float = field(default_factory=time.monotonic)
    last_token: Optional[float] = None
    done: bool = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.telemetry._labelled("ROUTER_TIME_TO_FIRST_TOKEN").observe(now - self.arrival)
        else:
            self.telemetry._labelled("ROUTER_INTER_TOKEN_LATENCY").observe((now - self.last_token) / n)
        self.last_token = now

    def finish(self, status: str) -> None:
        if not self.done:
            self.done = True
            self.telemetry._finish(self, status)
