"""One way to start a gRPC server in every role: health checking, reflection,
optional TLS/mTLS, and a graceful stop."""
from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional

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
# gRPC sets SO_REUSEPORT by default, so a second server on a taken port would
# silently share it (and its calls) with the first; a taken port must fail.
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.so_reuseport", 0),
    # gRPC sheds calls its handlers have not picked up yet past this many
    # (1000 by default) with a bare CANCELLED. Above every admission limit
    # (an engine's --max-num-seqs + --max-queued-requests, 768 by default),
    # a burst reaches the code that refuses it properly: RESOURCE_EXHAUSTED.
    ("grpc.server.max_pending_requests", 8192),
    ("grpc.server.max_pending_requests_hard_limit", 16384),
]


@dataclass
class TLSConfig:
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    ca_file: Optional[str] = None  # set: require client certificates (mTLS)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file)


def add_tls_arguments(parser) -> None:
    """--tls-cert/--tls-key/--tls-ca, the same on every role (and their TANDEM_TLS_* twins)."""
    from tandem.services.common.config import add_flag

    add_flag(parser, "--tls-cert", default=None,
             help="PEM certificate: with --tls-key, this role's gRPC server speaks TLS, and it is "
                  "the client certificate this role shows when it calls other roles (mTLS)")
    add_flag(parser, "--tls-key", default=None, help="PEM private key of --tls-cert")
    add_flag(parser, "--tls-ca", default=None,
             help="PEM CA bundle: calls to other roles go over TLS and trust only it; this role's "
                  "server (with --tls-cert/--tls-key) then also requires client certificates it "
                  "signed (mTLS); unset: plaintext gRPC between roles")


def tls_from_args(args) -> Optional["TLSConfig"]:
    """The TLSConfig the flags ask for, or None; a half-given pair is an error."""
    cert, key, ca = (getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_ca"))
    if bool(cert) != bool(key):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if path:
            try:
                _read(path)
            except OSError as exc:
                raise SystemExit(f"error: {flag} {path}: {exc.strerror}") from None
    if not (cert or ca):
        return None
    return TLSConfig(cert_file=cert, key_file=key, ca_file=ca)


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
        # Bounded: after the grace gRPC cancels what is left, so this returns
        # in about grace_s; the margin only guards against a stuck shutdown.
        self.server.stop(grace_s).wait(grace_s + 5.0)


def bind(server, host: str, port: int, tls: Optional[TLSConfig], port_flag: str = "--port") -> int:
    """Listen on host:port (sync or aio server, created with SERVER_OPTIONS),
    over TLS when `tls` has a certificate and key, requiring client
    certificates when it has a CA too; returns the bound port. A port that
    cannot be bound ends the process with one line naming it and `port_flag`."""
    address = f"{host}:{port}"
    # Asked first, so a taken port gets the OS's reason (gRPC's own is a log
    # line of its C core); gRPC still has the last word on a race.
    problem = why_unbindable(host, port, port_flag)
    bound = 0
    if problem is None:
        try:
            if tls and tls.enabled:
                creds = grpc.ssl_server_credentials(
                    [(_read(tls.key_file), _read(tls.cert_file))],
                    root_certificates=_read(tls.ca_file) if tls.ca_file else None,
                    require_client_auth=bool(tls.ca_file))
                bound = server.add_secure_port(address, creds)
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError:  # grpcio >= 1.50 raises where older ones returned 0
            bound = 0
    if bound == 0:
        problem = problem or why_unbindable(host, port, port_flag) or (
            f"gRPC could not bind it; pick another port with {port_flag}")
        raise SystemExit(f"error: cannot listen on {address}: {problem}")
    return bound


def why_unbindable(host: str, port: int, port_flag: str = "--port") -> Optional[str]:
    """Why a server cannot listen on host:port now, as the OS says it, and
    what to change; None when it can."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host.strip("[]"), port,
                                                              type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return None  # a name only gRPC's resolver knows: it tells
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and uvicorn do
            probe.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (f"the port is in use (another tandem process?); pick another port with "
                    f"{port_flag} (0 picks a free one)")
        if exc.errno == errno.EACCES:
            return f"permission denied; pick a port above 1023 with {port_flag}"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this machine; pick one with --host"
        return f"{exc.strerror or exc}; pick another port with {port_flag}"
    return None


def start_grpc_server(add_servicers: Callable[[grpc.Server], list[str]], host: str, port: int,
                      max_workers: int = 32, tls: Optional[TLSConfig] = None,
                      port_flag: str = "--port") -> RunningServer:
    """Start a server; `add_servicers` registers servicers and returns their full names.

    port 0 picks a free port; the chosen one is returned. A taken port ends
    the process with an error naming `port_flag`.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS)
    names = add_servicers(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = bind(server, host, port, tls, port_flag)
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
    creds = channel_credentials(tls)
    if creds is not None:
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)


def channel_credentials(tls: Optional[TLSConfig]) -> Optional[grpc.ChannelCredentials]:
    """Client credentials: TLS when a CA is given (trust only it), showing the
    certificate as a client certificate when one is given; None: plaintext."""
    if not (tls and tls.ca_file):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file),
        private_key=_read(tls.key_file) if tls.key_file else None,
        certificate_chain=_read(tls.cert_file) if tls.cert_file else None)


def exit_after_shutdown(code: int) -> NoReturn:
    """End a server process whose graceful shutdown is done, without waiting at
    interpreter exit for gRPC's worker threads: a server told to stop must stop
    within its --shutdown-timeout. (The KV store that once, in CI on
    2026-11-23, logged that it was stopping and never exited was stuck before
    this point: its signal handler deadlocked, kvstore/server.py says how.)"""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
