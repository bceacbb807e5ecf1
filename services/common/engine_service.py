"""What the prefill and decode services share: their flags, the engine they
build from them, conversions between protobuf and engine types, and the
engine metrics exported from `engine.stats()`.

Each service's server.py only wires these together with its servicer.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import grpc

from tandem.services.common.config import add_flag, config_error
from tandem.services.common.engine_protocol import ADMITTED_METADATA
from tandem.services.common.grpc_server import add_tls_arguments, tls_from_args
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def add_engine_arguments(parser: argparse.ArgumentParser, *, role: str, default_port: int,
                         default_metrics_port: int) -> None:
    add_flag(parser, "--host", default="127.0.0.1",
             help=f"address the {role} gRPC server binds (0.0.0.0 for all interfaces)")
    add_flag(parser, "--port", type=int, default=default_port,
             help=f"{role} gRPC port; 0 picks a free one (printed in the listening line)")
    add_flag(parser, "--model", default=DEFAULT_MODEL,
             help="model id, HF folder or .gguf file; the default is the embedded SmolLM2-135M-Instruct")
    add_flag(parser, "--tokenizer", default=None,
             help="tokenizer to use instead of the model's own: HF folder, .gguf file or 'smollm2' "
                  "(e.g. for a dummy-weight model given as a config.json alone)")
    add_flag(parser, "--kvstore", default=None,
             help="host:port of the KV store service; unset: no connector (KV stays local)")
    add_flag(parser, "--kv-direct", type=bool, default=False,
             help="direct KV transfer on one host instead of --kvstore: prefill keeps each prompt's "
                  "blocks in shared memory (CUDA IPC on a GPU) and decode copies them straight from "
                  "there; both roles must share the host (and /dev/shm); otherwise decode recomputes")
    add_flag(parser, "--kv-hold-timeout", type=float, default=30.0,
             help="with --kv-direct, prefill: seconds a prompt's blocks wait for the decode to copy "
                  "them when the router does not release them earlier")
    add_flag(parser, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(parser, "--num-blocks", type=int, default=None,
             help="KV blocks in the local cache; unset: sized from memory")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=None,
             help="token budget of one engine step (prompts longer than it prefill in chunks; an "
                  "aborted prompt stops computing within one); unset: 8192 on CUDA, 2048 on the CPU")
    add_flag(parser, "--max-num-seqs", type=int, default=256,
             help="most requests running at once")
    add_flag(parser, "--policy", default="fifo", choices=["fifo", "srtf"],
             help="scheduling policy: fifo, or srtf (shortest remaining tokens first)")
    add_flag(parser, "--no-prefix-caching", type=bool, default=False,
             help="turn off the local prefix cache")
    add_flag(parser, "--max-model-len", type=int, default=None,
             help="context length; unset: the model's own limit")
    add_flag(parser, "--metrics-port", type=int, default=default_metrics_port,
             help="HTTP port of this service's Prometheus /metrics; 0 turns it off")
    add_flag(parser, "--device", default="auto", choices=["auto", "cpu", "cuda"],
             help="where the model runs; auto: cuda when available (pick the GPU with CUDA_VISIBLE_DEVICES)")
    add_flag(parser, "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
             help="weight and KV dtype; auto: float32 on the CPU, bfloat16 on CUDA")
    add_flag(parser, "--load-format", default="auto", choices=["auto", "dummy"],
             help="dummy: random weights from the model's config (benchmarks without a checkpoint)")
    add_flag(parser, "--gpu-memory-utilization", type=float, default=0.9,
             help="share of the GPU this process may use, weights and KV cache together "
                  "(two engines on one GPU: 0.45 each)")
    add_flag(parser, "--enforce-eager", type=bool, default=False,
             help="no CUDA graphs for decode (slower; for debugging)")
    add_flag(parser, "--max-queued-requests", type=int, default=512,
             help="requests this instance holds beyond --max-num-seqs before it refuses new ones "
                  "with RESOURCE_EXHAUSTED (the router then tries another instance or answers 429)")
    add_flag(parser, "--shutdown-timeout", type=float, default=30.0,
             help="on SIGTERM: seconds in-flight requests get to finish (new ones are refused "
                  "and health says NOT_SERVING at once)")
    add_tls_arguments(parser)


def build_engine_config(args: argparse.Namespace, kv_role: str):
    from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    if args.kv_direct and args.kvstore:
        raise SystemExit("error: --kv-direct and --kvstore are two ways to move KV: pick one")
    connector = "direct" if args.kv_direct else ("kvstore" if args.kvstore else None)

    return EngineConfig(
        model=ModelConfig(model=args.model, max_model_len=args.max_model_len,
                          dtype=args.dtype, load_format=args.load_format,
                          tokenizer=getattr(args, "tokenizer", None)),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, policy=args.policy),
        kv_connector=connector,
        kv_connector_url=args.kvstore or None,
        kv_connector_tls=tls_from_args(args),
        kv_role=kv_role,
        kv_hold_timeout_s=args.kv_hold_timeout,
        device=args.device,
        enforce_eager=args.enforce_eager,
    )


# --- protobuf <-> engine -------------------------------------------------------

def sampling_params_from_proto(p: common_pb2.SamplingParams, **overrides):
    """The engine's SamplingParams; raises SamplingParamsError naming a bad field."""
    from tandem.engine import SamplingParams

    kwargs: dict = {
        "n": p.n or 1,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "min_tokens": p.min_tokens,
        "max_tokens": p.max_tokens if p.HasField("max_tokens") else None,
    }
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logprobs"):
        if p.HasField(name):
            kwargs[name] = getattr(p, name)
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def sampling_params_to_proto(params) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens)
    if params.max_tokens is not None:
        p.max_tokens = params.max_tokens
    if params.seed is not None:
        p.seed = params.seed
    if params.logprobs is not None:
        p.logprobs = params.logprobs
    return p


def logprob_to_proto(lp) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top={int(k): float(v) for k, v in lp.top.items()})


def load_from_stats(engine, stats) -> common_pb2.Load:
    """The engine's load and what it serves: the router validates requests
    against the model id, context and block size its engines report."""
    return common_pb2.Load(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        num_waiting_prompt_tokens=stats.num_waiting_prompt_tokens,
        kv_cache_usage=stats.kv_cache_usage, num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks, model_id=engine.model_id,
        max_model_len=engine.max_model_len, block_size=engine.engine.config.cache.block_size)


# A service whose engine loop died exits with this status, for its supervisor
# (`tandem up`, Kubernetes) to restart it.
ENGINE_DIED_EXIT_CODE = 3


class EngineServicer:
    """What the prefill and decode servicers share: their engine, metrics and
    admission, the mapping of engine errors to gRPC codes, and the Abort and
    GetLoad calls. Listed first among a servicer's bases, so these methods
    replace the generated UNIMPLEMENTED ones."""

    def __init__(self, engine, metrics: "EngineMetrics", admission: "Admission") -> None:
        self.engine = engine
        self.metrics = metrics
        self.admission = admission

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        await self.engine.abort(request.request_id)
        return common_pb2.AbortResponse()

    async def GetLoad(self, request: common_pb2.LoadRequest, context) -> common_pb2.Load:
        return load_from_stats(self.engine, self.engine.stats())

    async def refuse_if_dead(self, context) -> None:
        """Before admission: a dead engine says UNAVAILABLE, which the router
        may retry elsewhere (the request never reached it)."""
        if not self.engine.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this instance's engine has stopped ({self.engine.error!r}); it is "
                                "restarting")

    @contextlib.asynccontextmanager
    async def running(self, context, timer: "RequestTimer", num_prompt_tokens: int):
        """Around one admitted request: tells the caller it was admitted, turns
        engine errors into gRPC statuses, and counts a request whose caller
        left as finished with reason "abort"."""
        from tandem.engine import EngineDeadError, RequestFailedError, SamplingParamsError

        await context.send_initial_metadata(ADMITTED_METADATA)
        try:
            yield
        except SamplingParamsError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailedError as exc:
            self.metrics.finish_request(timer, "error", num_prompt_tokens)
            code = grpc.StatusCode.INVALID_ARGUMENT if exc.caused_by_request else grpc.StatusCode.INTERNAL
            await context.abort(code, str(exc))
        except EngineDeadError as exc:
            self.metrics.finish_request(timer, "error", num_prompt_tokens)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this instance's engine failed while running the request ({exc}); "
                                "retry shortly")
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away (client disconnect, router abort).
            self.metrics.finish_request(timer, "abort", num_prompt_tokens)
            raise


# --- metrics --------------------------------------------------------------------

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
        "prompt_tokens_computed": ("PROMPT_TOKENS_BY_SOURCE", {"source": "local_compute"}),
        "prompt_tokens_local_hit": ("PROMPT_TOKENS_BY_SOURCE", {"source": "local_cache_hit"}),
        "prompt_tokens_external": ("PROMPT_TOKENS_BY_SOURCE", {"source": "external_kv_transfer"}),
        "kv_save_bytes": ("KV_TRANSFER_BYTES", {"direction": "save"}),
        "kv_load_bytes": ("KV_TRANSFER_BYTES", {"direction": "load"}),
        "kv_save_blocks": ("KV_TRANSFER_BLOCKS", {"direction": "save"}),
        "kv_load_blocks": ("KV_TRANSFER_BLOCKS", {"direction": "load"}),
        "recompute_fallbacks": ("KV_RECOMPUTE_FALLBACKS", {}),
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


# --- back-pressure ----------------------------------------------------------------

class Admission:
    """Bounds the requests one instance holds (running plus queued) so a burst
    is refused at the door with RESOURCE_EXHAUSTED instead of growing the
    engine's queue, and its memory, without limit."""

    def __init__(self, limit: int, metrics: "EngineMetrics") -> None:
        self.limit = limit
        self.in_flight = 0
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def admit(self, context):
        if self.in_flight >= self.limit:
            self._metrics.rejected()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this instance holds {self.in_flight} requests, its limit (--max-num-seqs + "
                "--max-queued-requests); retry shortly or on another instance")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


# --- running a service ------------------------------------------------------------

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
    try:
        engine = AsyncLLMEngine(build_engine_config(args, kv_role), on_death=on_death)
    except ModelNotFoundError as exc:
        config_error(f"--model: {exc}")
    log.info("%s: model %s loaded in %.1fs", role, engine.model_id, time.monotonic() - t0)
    metrics = EngineMetrics(engine, role)
    start_metrics_server(args.metrics_port, host=args.host)
    poller = asyncio.create_task(metrics.poll_forever())
    admission = Admission(args.max_num_seqs + args.max_queued_requests, metrics)
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


# Test-only: with TANDEM_FAULT_HOOKS=1 in its environment, an engine service
# kills its own engine loop on SIGUSR1, as a real engine failure would.
FAULT_HOOKS_ENV = "TANDEM_FAULT_HOOKS"


def _install_fault_hook(engine, role: str) -> None:
    import signal

    log.warning("%s: %s=1: SIGUSR1 kills this engine's loop (fault tests only)", role, FAULT_HOOKS_ENV)
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, lambda: engine.inject_fault("SIGUSR1 fault hook"))


def run_main(add_arguments, serve, description: str) -> None:
    """The `main()` of a role's server module."""
    import sys

    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(serve(args))
