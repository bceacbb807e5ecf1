"""The pools of prefill and decode instances the router sends work to.

Membership is health-checked: an instance is taken out when its gRPC health
check or a call to it fails, and put back when a later health check passes.
Each check also fetches the instance's load (GetLoad) for the least-loaded
policy.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common.aio_server import make_aio_channel
from tandem.services.common.grpc_server import TLSConfig
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

# Call failures that say the instance (not the request) is the problem.
INSTANCE_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                               grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


@dataclass
class Instance:
    target: str  # host:port
    role: str  # prefill | decode
    stub: Any
    health_stub: Any
    channel: grpc.aio.Channel
    healthy: bool = False
    load: common_pb2.Load = field(default_factory=common_pb2.Load)
    # Tracked by this router, fresher than the polled load.
    outstanding_tokens: int = 0  # prompt tokens sent and not yet answered (prefill)
    in_flight: int = 0  # requests sent and not finished
    last_error: str = ""

    def load_score(self) -> tuple:
        if self.role == "prefill":
            return (max(self.outstanding_tokens, self.load.num_waiting_prompt_tokens),)
        busy = max(self.in_flight, self.load.num_running + self.load.num_waiting)
        return (busy, self.load.kv_cache_usage)


class BackendPool:
    """The instances of one tier (role)."""

    def __init__(self, role: str, targets: list[str], stub_factory: Callable[[grpc.aio.Channel], Any],
                 load_method: str = "GetLoad", check_interval_s: float = 1.0,
                 check_timeout_s: float = 1.0, tls: Optional[TLSConfig] = None) -> None:
        self.role = role
        self.check_interval_s = check_interval_s
        self.check_timeout_s = check_timeout_s
        self._load_method = load_method
        self.instances: list[Instance] = []
        for target in targets:
            channel = make_aio_channel(target, tls)
            self.instances.append(Instance(
                target=target, role=role, stub=stub_factory(channel),
                health_stub=health_pb2_grpc.HealthStub(channel), channel=channel))
        self._task: Optional[asyncio.Task] = None

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    def mark_failed(self, instance: Instance, reason: str) -> None:
        """Take an instance out until a health check passes again."""
        if instance.healthy:
            log.warning("%s instance %s taken out: %s", self.role, instance.target, reason)
        instance.healthy = False
        instance.last_error = reason

    async def check(self, instance: Instance) -> None:
        try:
            reply = await instance.health_stub.Check(health_pb2.HealthCheckRequest(service=""),
                                                     timeout=self.check_timeout_s)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise RuntimeError("health check says NOT_SERVING")
            instance.load = await getattr(instance.stub, self._load_method)(
                common_pb2.LoadRequest(), timeout=self.check_timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            self.mark_failed(instance, f"health check failed: {reason}")
            return
        if not instance.healthy:
            log.info("%s instance %s is healthy", self.role, instance.target)
        instance.healthy = True
        instance.last_error = ""

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self.instances))

    async def wait_until_healthy(self, timeout_s: float) -> bool:
        """At least one instance healthy within timeout_s (for startup)."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.check_all()
            if self.healthy() or not self.instances:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await self.check_all()
            except Exception:  # a broken check must not stop the checking
                log.exception("%s health checks failed", self.role)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for instance in self.instances:
            await instance.channel.close()


def parse_targets(text: Optional[str | list[str]]) -> list[str]:
    """'a:1,b:2' (or a list of such) -> ['a:1', 'b:2']; validates host:port."""
    if not text:
        return []
    parts = text if isinstance(text, list) else [text]
    targets = [t.strip() for part in parts for t in part.split(",") if t.strip()]
    for t in targets:
        host, _, port = t.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"instance address {t!r} is not host:port")
    return targets
