"""One way to start a gRPC server in every role: health checking, reflection,
optional TLS/mTLS, and a graceful stop."""
from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Large KV transfers: blocks of big models are several MiB each.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass
class TLSConfig:
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    ca_file: Optional[str] = None  # set: require client certificates (mTLS)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.set("", status)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()


def start_grpc_server(add_servicers: Callable[[grpc.Server], list[str]], host: str, port: int,
                      max_workers: int = 32, tls: Optional[TLSConfig] = None) -> RunningServer:
    """Start a server; `add_servicers` registers servicers and returns their full names.

    port 0 picks a free port; the chosen one is returned.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    names = add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    if tls and tls.enabled:
        creds = grpc.ssl_server_credentials(
            [(_read(tls.key_file), _read(tls.cert_file))],
            root_certificates=_read(tls.ca_file) if tls.ca_file else None,
            require_client_auth=bool(tls.ca_file))
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise SystemExit(f"error: cannot listen on {address} (port in use?)")
    server.start()
    log.info("gRPC %s listening on %s:%d", ",".join(names), host, bound)
    return RunningServer(server=server, port=bound, health=health_servicer)


# A peer that restarts (a kvstore or decode pod) should be retried within
# seconds, not after gRPC's default back-off of up to two minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def make_channel(target: str, tls: Optional[TLSConfig] = None) -> grpc.Channel:
    """A client channel to another role, with the same message limits and a short reconnect back-off."""
    options = CHANNEL_OPTIONS + RECONNECT_OPTIONS
    if tls and tls.ca_file:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(tls.ca_file),
            private_key=_read(tls.key_file) if tls.key_file else None,
            certificate_chain=_read(tls.cert_file) if tls.cert_file else None)
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)
