"""The pools of prefill and decode instances the router sends work to.

Membership is health-checked: an instance is taken out when its gRPC health
check or a call to it fails, and put back when a later health check passes.
Each check also fetches the instance's load (GetLoad) for the least-loaded
policy, with the model the instance serves, which a pool's `vet` may refuse
(engine_reports.py: every instance must serve the same model).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
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
    slow_checks: int = 0  # consecutive health checks that timed out

    def load_score(self) -> tuple:
        if self.role == "prefill":
            return (max(self.outstanding_tokens, self.load.num_waiting_prompt_tokens),)
        busy = max(self.in_flight, self.load.num_running + self.load.num_waiting)
        return (busy, self.load.kv_cache_usage)


class BackendPool:
    """The instances of one tier (role).

    Targets are host:port. A host that is a DNS name (a Kubernetes headless
    Service) is resolved to all its addresses on every health round, so pods
    that scale out join the pool and pods that go away leave it. An instance
    whose address left DNS takes no new requests; its channel is closed once
    its in-flight requests are done.
    """

    # A health check that times out this many rounds in a row takes the instance
    # out; a refused connection or a failed call does at once.
    SLOW_CHECKS_TO_FAIL = 3

    def __init__(self, role: str, targets: list[str], stub_factory: Callable[[grpc.aio.Channel], Any],
                 load_method: str = "GetLoad", check_interval_s: float = 1.0,
                 check_timeout_s: float = 2.0, tls: Optional[TLSConfig] = None,
                 on_checked: Optional[Callable[["BackendPool"], None]] = None) -> None:
        self.role = role
        self.targets = list(targets)
        self.check_interval_s = check_interval_s
        self.check_timeout_s = check_timeout_s
        self._load_method = load_method
        self._stub_factory = stub_factory
        self._tls = tls
        self._on_checked = on_checked
        self.instances: list[Instance] = []
        self._retired: list[Instance] = []  # left DNS; closed when idle
        self._task: Optional[asyncio.Task] = None
        self._origin: dict[str, str] = {}  # address -> the target it was resolved from
        # Why an instance that passed its health check must still take no
        # requests, given the Load it reported; None: it may.
        self.vet: Optional[Callable[[Instance, common_pb2.Load], Optional[str]]] = None

    def _add(self, address: str, server_name: Optional[str]) -> Instance:
        channel = make_aio_channel(address, self._tls, server_name=server_name)
        instance = Instance(target=address, role=self.role, stub=self._stub_factory(channel),
                            health_stub=health_pb2_grpc.HealthStub(channel), channel=channel)
        self.instances.append(instance)
        return instance

    async def refresh(self) -> None:
        """Resolve every target to its current addresses; add and retire instances."""
        wanted: dict[str, Optional[str]] = {}  # address -> TLS server name
        known = {i.target for i in self.instances}
        for target in self.targets:
            host, port = split_target(target)
            try:
                addresses = await resolve(host, port)
            except OSError as exc:
                # A DNS blip must not empty the pool: keep what this target had.
                log.warning("%s: cannot resolve %s (%s); keeping its known instances", self.role,
                            target, exc)
                addresses = [a for a in known if self._origin.get(a) == target]
            for address in addresses:
                wanted[address] = None if _is_ip(host) else host
                self._origin[address] = target
        for instance in list(self.instances):
            if instance.target not in wanted:
                log.info("%s instance %s left DNS; taking it out", self.role, instance.target)
                self.instances.remove(instance)
                self._retired.append(instance)
        for address, server_name in wanted.items():
            if address not in known:
                log.info("%s instance %s found", self.role, address)
                self._add(address, server_name)
        for instance in list(self._retired):
            if instance.in_flight == 0:
                self._retired.remove(instance)
                await instance.channel.close()

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
            load = await getattr(instance.stub, self._load_method)(
                common_pb2.LoadRequest(), timeout=self.check_timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            slow = isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            instance.slow_checks = instance.slow_checks + 1 if slow else 0
            if slow and instance.slow_checks < self.SLOW_CHECKS_TO_FAIL:
                return  # busy, not gone: one late answer must not empty the pool under load
            reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            self.mark_failed(instance, f"health check failed: {reason}")
            return
        instance.load = load
        refusal = self.vet(instance, load) if self.vet else None
        if refusal:
            if refusal != instance.last_error:  # once, not every round
                log.error("%s instance %s refused: %s", self.role, instance.target, refusal)
            self.mark_failed(instance, refusal)
            return
        if not instance.healthy:
            log.info("%s instance %s is healthy", self.role, instance.target)
        instance.healthy = True
        instance.slow_checks = 0
        instance.last_error = ""

    async def check_all(self) -> None:
        await self.refresh()
        await asyncio.gather(*(self.check(i) for i in self.instances))
        if self._on_checked:
            self._on_checked(self)

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
        for instance in self.instances + self._retired:
            await instance.channel.close()


def split_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as host:port (IPv6 in brackets), in the
    resolver's order, without duplicates.

    One address family only: IPv4 when there is any, else IPv6. A dual-stack
    name (`localhost` on many hosts, a headless Service in a dual-stack
    cluster) gives each server one address of each family; counting both would
    count every server twice, and one of the two is dead when the server binds
    0.0.0.0."""
    if _is_ip(host):
        return [_address(host, port)]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return addresses_of(infos, port)


def addresses_of(infos: list[tuple], port: int) -> list[str]:
    """getaddrinfo's answer as host:port strings, one family (see resolve)."""
    if any(info[0] == socket.AF_INET for info in infos):
        infos = [info for info in infos if info[0] == socket.AF_INET]
    out: list[str] = []
    for _family, _, _, _, sockaddr in infos:
        address = _address(sockaddr[0], port)
        if address not in out:
            out.append(address)
    return out


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


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
