"""An engine role's process: its service flags, the engine it builds from
EngineArgs, serving gRPC and /metrics, and its lifecycle (SIGINT/SIGTERM
drains; an engine that dies ends the process for its supervisor to restart).

Each role's server.py only adds its servicer.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time

from tandem.engine.config import ConfigError, EngineArgs, EngineConfig
from tandem.services.common.config import add_flag, config_error
from tandem.services.common.engine_metrics import EngineMetrics
from tandem.services.common.gc_pauses import freeze_startup_objects, watch_pauses
from tandem.services.common.grpc_server import add_tls_arguments, tls_from_args
from tandem.services.common.role_servicer import Admission

log = logging.getLogger(__name__)

# Seconds any one call to the KV store may take before the engine computes instead.
KV_STORE_TIMEOUT_S = 5.0

# A service whose engine loop died exits with this status, for its supervisor
# (`tandem up`, Kubernetes) to restart it.
ENGINE_DIED_EXIT_CODE = 3

# Test-only: with TANDEM_FAULT_HOOKS=1 in its environment, an engine service
# kills its own engine loop on SIGUSR1, as a real engine failure would.
FAULT_HOOKS_ENV = "TANDEM_FAULT_HOOKS"


def add_service_arguments(parser: argparse.ArgumentParser, *, role: str, default_port: int,
                          default_metrics_port: int) -> None:
    """The flags of an engine role that are not engine settings: where it
    listens, how much it queues, how it stops, TLS."""
    add_flag(parser, "--host", default="127.0.0.1",
             help=f"address the {role} gRPC server binds (0.0.0.0 for all interfaces)")
    add_flag(parser, "--port", type=int, default=default_port,
             help=f"{role} gRPC port; 0 picks a free one (printed in the listening line)")
    add_flag(parser, "--metrics-port", type=int, default=default_metrics_port,
             help="HTTP port of this service's Prometheus /metrics; 0 turns it off")
    add_flag(parser, "--max-queued-requests", type=int, default=512,
             help="requests this instance holds beyond --max-num-seqs before it refuses new ones "
                  "with RESOURCE_EXHAUSTED (the router then tries another instance or answers 429)")
    add_flag(parser, "--shutdown-timeout", type=float, default=30.0,
             help="on SIGTERM: seconds in-flight requests get to finish (new ones are refused "
                  "and health says NOT_SERVING at once)")
    add_tls_arguments(parser)


def add_engine_role_arguments(parser: argparse.ArgumentParser, *, role: str, default_port: int,
                              default_metrics_port: int) -> None:
    """Every flag of an engine role: its service flags, then the engine's (EngineArgs)."""
    add_service_arguments(parser, role=role, default_port=default_port,
                          default_metrics_port=default_metrics_port)
    EngineArgs.add_cli_args(parser)


def engine_config_from_args(args: argparse.Namespace, kv_role: str) -> EngineConfig:
    """The role's EngineConfig from its parsed flags; a bad setting stops the
    start with `error: ...` naming the flag."""
    try:
        return EngineArgs.from_cli_args(args, kv_role=kv_role).create_engine_config()
    except ConfigError as exc:
        config_error(str(exc))


async def wait_for_shutdown_signal() -> str:
    """Block until SIGINT or SIGTERM; returns the signal's name."""
    import signal

    loop = asyncio.get_running_loop()
    got: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s.name))
    return await got


async def run_engine_service(args: argparse.Namespace, *, role: str, kv_role: str,
                             add_servicers) -> int:
    """Load the engine, serve gRPC + /metrics, print the listening line, run until
    SIGINT/SIGTERM or until the engine dies, then stop.

    `add_servicers(server, engine, metrics, admission)` registers the role's
    servicer and returns the full service names (for health and reflection).

    SIGTERM drains: health turns NOT_SERVING (routers stop sending), new calls
    are refused, in-flight ones get --shutdown-timeout seconds to finish.
    An engine whose loop died turns health NOT_SERVING at once (its in-flight
    calls have already failed with UNAVAILABLE) and the process exits with
    ENGINE_DIED_EXIT_CODE, so `tandem up` or Kubernetes restarts it: a process
    that answers health checks but cannot serve is the worst kind of failure.
    """
    from tandem.engine import AsyncLLMEngine
    from tandem.engine.loader import ModelNotFoundError
    from tandem.services.common.aio_server import start_aio_grpc_server
    from tandem.services.common.metrics import start_metrics_server

    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    died: asyncio.Future = loop.create_future()

    def on_death(exc: BaseException) -> None:  # on the engine thread
        loop.call_soon_threadsafe(lambda: died.done() or died.set_result(exc))

    # Created on the serving loop: the engine hands results back to the loop
    # that awaits them. Loading blocks the loop, but nothing else runs yet.
    config = engine_config_from_args(args, kv_role)
    if role == "prefill" and config.speculative is not None:
        # A prefill samples one token per request: proposals would never be
        # verified, and a draft model would only take memory. `tandem up` hands
        # every engine the same flags; the decode role speculates.
        log.info("prefill: --speculative-config is for the decode role; this engine does not speculate")
        config = dataclasses.replace(config, speculative=None)
    kv_store = None
    if config.kv_transfer == "store":
        from tandem.services.kvstore.mover import ENGINE_SWITCH_INTERVAL_S, MovedBlockStoreClient

        # KV bytes move in a helper process, off this one's busy GIL. Short
        # deadlines: a store that does not answer costs a recompute, not a stalled request.
        kv_store = MovedBlockStoreClient(args.kv_store, timeout_s=KV_STORE_TIMEOUT_S, tls=tls_from_args(args))
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)  # see there: the mover's answers wait for the GIL
    try:
        engine = AsyncLLMEngine(config, on_death=on_death, kv_store=kv_store)
    except ModelNotFoundError as exc:
        config_error(f"--model: {exc}")
    except ConfigError as exc:  # found while loading (a draft model of another vocabulary)
        config_error(str(exc))
    log.info("%s: model %s loaded in %.1fs", role, engine.model_id, time.monotonic() - t0)
    frozen = freeze_startup_objects()  # no full collection walks them again (gc_pauses.py says why)
    watch_pauses()
    log.info("%s: %d objects made while loading are frozen out of garbage collection", role, frozen)
    metrics = EngineMetrics(engine, role)
    start_metrics_server(args.metrics_port, host=args.host)
    poller = asyncio.create_task(metrics.poll_forever())
    admission = Admission(engine.engine.config.scheduler.max_num_seqs + args.max_queued_requests, metrics)
    server = await start_aio_grpc_server(lambda s: add_servicers(s, engine, metrics, admission),
                                         args.host, args.port, tls=tls_from_args(args))
    if os.environ.get(FAULT_HOOKS_ENV) == "1":
        _install_fault_hook(engine, role)
    if args.metrics_port:
        print(f"{role} metrics on http://{args.host}:{args.metrics_port}/metrics", flush=True)
    # The launcher and tests wait for exactly this line.
    print(f"{role} listening on {args.host}:{server.port}", flush=True)
    signalled = asyncio.ensure_future(wait_for_shutdown_signal())
    code, grace_s = 0, args.shutdown_timeout
    try:
        await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
        if died.done():
            code = ENGINE_DIED_EXIT_CODE
            await server.set_serving(False)
            log.error("%s: the engine loop died (%r); health is NOT_SERVING, exiting with status %d "
                      "for the supervisor to restart this instance", role, died.result(), code)
            grace_s = 1.0  # the failed calls' statuses are already on their way
        else:
            log.info("%s: %s received; draining %d in-flight request(s) for up to %.0fs", role,
                     signalled.result(), admission.in_flight, args.shutdown_timeout)
    finally:
        signalled.cancel()
        poller.cancel()
        await server.stop(grace_s=grace_s)
        engine.shutdown()
    return code


def _install_fault_hook(engine, role: str) -> None:
    import signal

    log.warning("%s: %s=1: SIGUSR1 kills this engine's loop (fault tests only)", role, FAULT_HOOKS_ENV)
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, lambda: engine.inject_fault("SIGUSR1 fault hook"))
