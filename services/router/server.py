"""The router role: the OpenAI-compatible HTTP gateway and the public gRPC
API on one asyncio loop, in front of pools of prefill and decode instances.

    python -m tandem.services.router.server --prefill 127.0.0.1:50061 --decode 127.0.0.1:50071
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from typing import Optional

from tandem.engine.config import DEFAULT_MODEL
from tandem.services.common.config import add_flag, config_error, run_main
from tandem.services.common.grpc_server import add_tls_arguments, tls_from_args

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.services.router.policies import POLICIES

    add_flag(parser, "--host", default="127.0.0.1",
             help="address the HTTP gateway and the gRPC API bind (0.0.0.0 for all interfaces)")
    add_flag(parser, "--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible gateway; 0 picks a free one")
    add_flag(parser, "--grpc-port", type=int, default=50051,
             help="port of the public gRPC API (tandem.v1.TandemService); 0 picks a free one, -1 turns it off")
    add_flag(parser, "--prefill", default="",
             help="prefill instances as host:port,host:port; none: decode prefills every prompt")
    add_flag(parser, "--decode", default="", help="decode instances as host:port,host:port (at least one)")
    add_flag(parser, "--model", default=DEFAULT_MODEL,
             help="the model the instances serve, for its tokenizer and chat template (the model id "
                  "and context length requests are checked against are what the instances report); "
                  "a Hub id (org/name) fetches its tokenizer files only, with huggingface_hub's "
                  "progress bars")
    add_flag(parser, "--served-model-name", default=None, nargs="+", metavar="NAME",
             help="the names requests may give as their model (as vllm serve's flag): each is "
                  "listed by /v1/models and the first is the model answers report; unset: the "
                  "model the engines report (env: comma-separated)")
    add_flag(parser, "--tokenizer", default=None,
             help="tokenizer to use instead of the model's own: HF folder, .gguf file or 'smollm2' "
                  "(keep it equal to the engines')")
    # The engines' flags of the same names (and env twins): the router reads the
    # tokenizer files of the same Hub snapshot the engines read the weights of.
    add_flag(parser, "--revision", default=None,
             help="with a Hub id as --model: the branch, tag or commit (keep it equal to the engines'); "
                  "unset: main")
    add_flag(parser, "--download-dir", default=None, metavar="DIR",
             help="with a Hub id as --model: the Hugging Face cache folder; unset: huggingface_hub's")
    add_flag(parser, "--routing", default="least_loaded", choices=list(POLICIES),
             help="how to pick an instance in each tier: round_robin, least_loaded (outstanding "
                  "prefill tokens; running requests and KV usage for decode), or prefix_affinity "
                  "(prompts that share their first block go to the same instance)")
    add_flag(parser, "--affinity-tokens", type=int, default=16,
             help="prefix_affinity: how many leading prompt tokens pick the instance (one block)")
    add_flag(parser, "--prefill-threshold", type=int, default=32,
             help="prompts shorter than this many tokens skip the prefill tier and prefill on decode")
    add_flag(parser, "--prefill-timeout", type=float, default=300.0,
             help="seconds a prefill call may take; past it the request fails with 504 (it reached "
                  "that engine, so it is not sent to another)")
    add_flag(parser, "--api-key", default=None, nargs="*",
             help="API keys clients must send as 'Authorization: Bearer <key>' (several allowed; "
                  "env: comma-separated); unset: no authentication")
    add_flag(parser, "--max-in-flight", type=int, default=1024,
             help="requests in flight beyond which new ones get HTTP 429 / RESOURCE_EXHAUSTED")
    add_flag(parser, "--startup-timeout", type=float, default=300.0,
             help="seconds to wait at startup for a healthy decode instance")
    add_flag(parser, "--max-body-bytes", type=int, default=4 * 1024 * 1024,
             help="largest request body (HTTP) or message (gRPC API) accepted; larger ones get "
                  "413 / RESOURCE_EXHAUSTED")
    add_flag(parser, "--body-read-timeout", type=float, default=30.0,
             help="seconds an HTTP request's body may take to arrive; a slower one gets 408 and its "
                  "connection is closed (a request takes an in-flight slot only once its body is in)")
    add_flag(parser, "--max-choices-per-request", type=int, default=256,
             help="most completions one request may ask for (prompts x n); more get 400 naming "
                  "prompt or n")
    add_flag(parser, "--tokenizer-workers", type=int, default=2,
             help="processes that parse request bodies, apply the chat template and tokenize, off "
                  "the event loop (so one huge body cannot stall other streams)")
    add_flag(parser, "--tokenizer-queue", type=int, default=256,
             help="requests that may wait for a tokenizer worker; more get HTTP 429 / "
                  "RESOURCE_EXHAUSTED with Retry-After")
    add_flag(parser, "--shutdown-timeout", type=float, default=30.0,
             help="on SIGTERM: seconds in-flight requests get to finish after the router stops "
                  "accepting new ones")
    add_flag(parser, "--health-interval", type=float, default=1.0,
             help="seconds between health rounds: each re-resolves DNS names in --prefill/--decode "
                  "(all their addresses join) and checks every instance")
    add_tls_arguments(parser)


def api_keys_from_flag(keys: Optional[list[str]]) -> list[str]:
    """The keys of --api-key / TANDEM_API_KEY; unset: none (no authentication).
    An empty one stops the start: it would have turned authentication off."""
    if keys is None:
        return []
    if not keys or any(not k.strip() for k in keys):
        config_error("--api-key: empty key; give non-empty keys (TANDEM_API_KEY: comma-separated), "
                     "or leave both --api-key and TANDEM_API_KEY unset to serve without authentication")
    return list(keys)


def _served_model(args: argparse.Namespace):
    """The tokenizer only: the model's id and context come from the engines,
    and its config would bring torch into this process (loader.load_tokenizer)."""
    from tandem.engine.hub import HubSource
    from tandem.engine.loader import (EMBEDDED_ALIASES, EMBEDDED_MODEL_ID, ModelNotFoundError,
                                      load_tokenizer)
    from tandem.services.router.frontend import ServedModel

    try:
        hub_source = HubSource(getattr(args, "revision", None), getattr(args, "download_dir", None))
        loaded = load_tokenizer(args.model, tokenizer=getattr(args, "tokenizer", None),
                                hub_source=hub_source)
    except ModelNotFoundError as exc:
        config_error(f"--model: {exc}")
    aliases = {args.model}
    if loaded.model_id == EMBEDDED_MODEL_ID:
        aliases |= set(EMBEDDED_ALIASES)
    return ServedModel(model_id=loaded.model_id, tokenizer=loaded.tokenizer, aliases=aliases,
                       served_names=served_names_from_flag(getattr(args, "served_model_name", None)))


def served_names_from_flag(names: Optional[list[str]]) -> list[str]:
    """--served-model-name's names, in order, once each; an empty one stops the start."""
    if names is None:
        return []
    if not names or any(not n.strip() for n in names):
        config_error("--served-model-name: empty name; give one or more non-empty names")
    return list(dict.fromkeys(n.strip() for n in names))


class _Uvicorn:
    """uvicorn's Server without its own signal handling: this process stops the
    HTTP server, the gRPC server and the pools together on SIGINT/SIGTERM."""

    def __init__(self, app, host: str, port: int, shutdown_timeout_s: float) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                            lifespan="off",
                                            timeout_graceful_shutdown=shutdown_timeout_s))

    async def start(self) -> tuple[asyncio.Task, int]:
        task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if task.done():
                task.result()
                raise SystemExit("error: the HTTP gateway stopped while starting (port in use?)")
            await asyncio.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return task, port


async def _serve(args: argparse.Namespace) -> int:
    from tandem.services.common.aio_server import start_aio_grpc_server
    from tandem.services.router.app import GatewayConfig, create_app
    from tandem.services.router.backends import BackendPool, parse_targets
    from tandem.services.router.dispatch import Dispatcher
    from tandem.services.router.engine_reports import EngineReports
    from tandem.services.router.frontend import Frontend
    from tandem.services.router.grpc_api import TandemServicer, add_tandem_service
    from tandem.services.router.policies import make_policy
    from tandem.services.router.prompts import PromptPool
    from tandem.services.router.telemetry import RouterTelemetry
    from tandem.v1 import decode_pb2_grpc, prefill_pb2_grpc

    try:
        prefill_targets = parse_targets(args.prefill)
        decode_targets = parse_targets(args.decode)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not decode_targets:
        raise SystemExit("error: --decode needs at least one host:port of a decode instance")
    api_keys = api_keys_from_flag(args.api_key)
    for flag, value, least in (("--tokenizer-workers", args.tokenizer_workers, 1),
                               ("--tokenizer-queue", args.tokenizer_queue, 0),
                               ("--max-choices-per-request", args.max_choices_per_request, 1)):
        if value < least:
            config_error(f"{flag}: {value} is below {least}; give at least {least}")
    if not args.body_read_timeout > 0:
        config_error(f"--body-read-timeout: {args.body_read_timeout} must be above 0 seconds")
    model = _served_model(args)
    telemetry = RouterTelemetry(model.model_id)
    # Before any traffic: starting the workers takes seconds (each imports transformers).
    # Each job gets the context limit the engines report at that moment.
    prompts = PromptPool(model.tokenizer, max_choices=args.max_choices_per_request,
                         workers=args.tokenizer_workers, queue=args.tokenizer_queue)
    tls = tls_from_args(args)
    reports = EngineReports(model.model_id)

    def pool(role: str, targets: list[str], stub) -> BackendPool:
        return reports.watch(BackendPool(
            role, targets, stub, check_interval_s=args.health_interval, tls=tls,
            on_checked=lambda p: telemetry.healthy_instances(role, len(p.healthy()))))

    prefill = pool("prefill", prefill_targets, prefill_pb2_grpc.PrefillServiceStub)
    decode = pool("decode", decode_targets, decode_pb2_grpc.DecodeServiceStub)
    if not await decode.wait_until_healthy(args.startup_timeout):
        log.warning("no decode instance is healthy yet; requests get 503 until one is and has "
                    "reported its model")
    await prefill.check_all()
    prefill.start()
    decode.start()
    dispatcher = Dispatcher(prefill, decode, make_policy(args.routing, args.affinity_tokens),
                            make_policy(args.routing, args.affinity_tokens), args.prefill_threshold,
                            telemetry, prefill_timeout_s=args.prefill_timeout)
    frontend = Frontend(model, dispatcher, prompts, reports)
    grpc_server = None
    if args.grpc_port >= 0:
        servicer = TandemServicer(frontend, telemetry, api_keys, args.max_in_flight)
        # Public clients get the HTTP body limit, not the 256 MiB the roles use for KV.
        grpc_server = await start_aio_grpc_server(
            lambda s: add_tandem_service(s, servicer), args.host, args.grpc_port,
            max_receive_bytes=args.max_body_bytes, port_flag="--grpc-port")
        print(f"router grpc listening on {args.host}:{grpc_server.port}", flush=True)
    app = create_app(frontend, telemetry, {"prefill": prefill, "decode": decode},
                     GatewayConfig(api_keys=api_keys, max_in_flight=args.max_in_flight,
                                   max_body_bytes=args.max_body_bytes,
                                   body_read_timeout_s=args.body_read_timeout))
    http = _Uvicorn(app, args.host, args.port, args.shutdown_timeout)
    http_task, http_port = await http.start()
    # The launcher and tests wait for exactly this line.
    print(f"router listening on {args.host}:{http_port}", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait({asyncio.create_task(stop.wait()), http_task},
                       return_when=asyncio.FIRST_COMPLETED)
    # Drain: stop accepting on both APIs at once, let in-flight requests finish
    # within --shutdown-timeout, then close the pools.
    log.info("router stopping: draining %d in-flight request(s) for up to %.0fs",
             telemetry.in_flight, args.shutdown_timeout)
    http.server.should_exit = True
    if grpc_server is not None:
        await grpc_server.stop(grace_s=args.shutdown_timeout)
    await asyncio.gather(http_task, return_exceptions=True)
    await prefill.close()
    await decode.close()
    prompts.close()
    return 0


def serve(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


def main() -> None:
    run_main(add_arguments, serve, "tandem router: OpenAI-compatible HTTP gateway and public gRPC API.")


if __name__ == "__main__":
    main()
