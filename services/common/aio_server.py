"""gRPC servers on asyncio (grpc.aio) for the roles whose work is async: the
prefill and decode services (around AsyncLLMEngine) and the router's public
API (next to its FastAPI app on the same loop).

Mirrors `grpc_server.start_grpc_server`: health checking, reflection, the same
message limits and optional TLS/mTLS.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.services.common.grpc_server import (CHANNEL_OPTIONS, RECONNECT_OPTIONS, SERVER_OPTIONS,
                                                TLSConfig, bind, channel_credentials)

log = logging.getLogger(__name__)


@dataclass
class RunningAioServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    names: list[str]

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_aio_grpc_server(add_servicers: Callable[[grpc.aio.Server], list[str]], host: str,
                                port: int, tls: Optional[TLSConfig] = None,
                                max_receive_bytes: Optional[int] = None,
                                port_flag: str = "--port") -> RunningAioServer:
    """Start a server on the running loop; `add_servicers` registers servicers and
    returns their full names. port 0 picks a free port; the chosen one is returned;
    a taken one ends the process with an error naming `port_flag`.
    max_receive_bytes: a smaller limit on incoming messages (public APIs)."""
    options = list(SERVER_OPTIONS)
    if max_receive_bytes:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options)
    names = add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = bind(server, host, port, tls, port_flag)
    await server.start()
    running = RunningAioServer(server=server, port=bound, health=health_servicer, names=names)
    await running.set_serving(True)
    log.info("gRPC %s listening on %s:%d", ",".join(names), host, bound)
    return running


def make_aio_channel(target: str, tls: Optional[TLSConfig] = None,
                     server_name: Optional[str] = None) -> grpc.aio.Channel:
    """An asyncio client channel to another role, with the same message limits.
    server_name: the name its TLS certificate must carry, when `target` is an
    address resolved from that name."""
    creds = channel_credentials(tls)
    if creds is not None:
        options = CHANNEL_OPTIONS + RECONNECT_OPTIONS
        if server_name:
            options = options + [("grpc.ssl_target_name_override", server_name)]
        return grpc.aio.secure_channel(target, creds, options=options)
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
