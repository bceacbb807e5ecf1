"""`tandem bench serve`: load an OpenAI-compatible endpoint and measure it.

Requests come from a generated dataset (datasets.py) and are sent on the
schedule of an arrival process (arrivals.py), optionally capped at a number
in flight; every request streams, and its chunks are timed (client.py). The
records and their summary (metrics.py) are printed, and with --result-dir
written as JSON and plotted.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import httpx

from tandem.bench import report
from tandem.bench.arrivals import arrival_offsets
from tandem.bench.client import ENDPOINTS, EndpointConfig, first_model, resolve_api_key, send
from tandem.bench.datasets import DATASETS, BenchRequest, DatasetConfig, Message, ShareGPTLike, generate, words
from tandem.bench.metrics import RequestRecord, Summary, parse_slos, summarize
from tandem.services.common.config import add_flag


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is Poisson
    max_concurrency: Optional[int] = None  # cap on requests in flight
    warmups: int = 1  # requests sent one by one before timing starts, never counted

    def __post_init__(self) -> None:
        if self.warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.warmups}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class ServeConfig:
    endpoint: EndpointConfig
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    slos_ms: dict[str, float] = field(default_factory=dict)
    progress: bool = True

    def to_json(self) -> dict:
        d = asdict(self)
        d["endpoint"]["api_key"] = "***" if self.endpoint.api_key else None  # never write secrets
        return d


@dataclass
class ServeResult:
    config: ServeConfig
    records: list[RequestRecord]
    summary: Summary

    def to_json(self) -> dict:
        return {"config": self.config.to_json(), "summary": self.summary.to_json(),
                "requests": [r.to_json() for r in self.records]}


def run_serve(config: ServeConfig, requests: Optional[list[BenchRequest]] = None) -> ServeResult:
    requests = requests if requests is not None else generate(config.dataset)
    records, duration = asyncio.run(_drive(config, requests))
    return ServeResult(config, records, summarize(records, duration, config.slos_ms))


def warmup_request(like: BenchRequest, index: int) -> BenchRequest:
    """A request as long as `like` (answer capped at 16 tokens) with words of its
    own, so that no measured request finds its prompt in a prefix cache."""
    rng = random.Random(f"warmup-{index}")
    return BenchRequest(messages=(Message("user", words(rng, like.prompt_len)),), prompt_len=like.prompt_len,
                        output_len=min(like.output_len, 16))


async def _drive(config: ServeConfig, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    from tqdm import tqdm

    load = config.load
    # Seeded apart from the dataset so changing the rate never changes the prompts.
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, seed=config.dataset.seed + 1)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(total=len(requests), unit="req", disable=not config.progress, file=sys.stderr, mininterval=0.5)
    client_limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=client_limits, timeout=config.endpoint.timeout_s) as client:
        # A fresh server pays one-off costs (lazy initialisation, first compilations) on
        # its first requests; they would land in the first measured requests' TTFT.
        for i in range(load.warmups):
            warm = await send(client, config.endpoint, warmup_request(requests[i % len(requests)], i), -1,
                              time.perf_counter())
            if not warm.success:
                print(f"warning: warm-up request failed: {warm.error}", file=sys.stderr)
        start = time.perf_counter()

        async def one(index: int, request: BenchRequest) -> RequestRecord:
            delay = start + offsets[index] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                record = await send(client, config.endpoint, request, index, start)
            else:
                async with limit:
                    record = await send(client, config.endpoint, request, index, start)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


# --- command line ------------------------------------------------------------------------


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by serve and sweep: what to send, how, and the SLOs."""
    add_flag(p, "--model", default=None, help="model name to request (default: the first one GET /models lists)")
    add_flag(p, "--endpoint", default="chat", choices=ENDPOINTS,
             help="chat: /chat/completions with messages; completions: /completions with a plain prompt")
    add_flag(p, "--api-key", default=None, help="bearer token for the server; OPENAI_API_KEY is used when unset")
    add_flag(p, "--no-ignore-eos", type=bool,
             help="do not send ignore_eos/min_tokens (for servers that reject unknown fields); answers may "
                  "then stop early at an end-of-sequence token")
    add_flag(p, "--temperature", type=float, default=0.0, help="sampling temperature of every request")
    add_flag(p, "--request-timeout", type=float, default=600.0,
             help="seconds to wait for the server (to connect, or for the next chunk) before a request "
                  "counts as failed")
    add_flag(p, "--dataset", default="random", choices=DATASETS,
             help="random: uniform lengths; sharegpt: long-tailed ShareGPT-like lengths; shared-prefix: groups "
                  "sharing a long system prompt; multi-turn: conversations whose turns include earlier turns")
    add_flag(p, "--num-prompts", type=int, default=100, help="requests to send")
    add_flag(p, "--seed", type=int, default=0, help="seed of the dataset and of the arrival times")
    add_flag(p, "--random-input-len", type=int, default=256,
             help="words per prompt (random), per question (shared-prefix) or per user turn (multi-turn)")
    add_flag(p, "--random-output-len", type=int, default=128, help="tokens to generate per request (not sharegpt)")
    add_flag(p, "--random-range-ratio", type=float, default=0.0,
             help="lengths are uniform in [L*(1-r), L*(1+r)]; 0 gives every request exactly L")
    d = ShareGPTLike()
    add_flag(p, "--sharegpt-input-median", type=float, default=d.input_median,
             help=f"median prompt words of sharegpt (log-normal, sigma {d.input_sigma})")
    add_flag(p, "--sharegpt-output-median", type=float, default=d.output_median,
             help=f"median output tokens of sharegpt (log-normal, sigma {d.output_sigma})")
    add_flag(p, "--sharegpt-max-input-len", type=int, default=d.max_input_len, help="cap on sharegpt prompt words")
    add_flag(p, "--sharegpt-max-output-len", type=int, default=d.max_output_len, help="cap on sharegpt output tokens")
    add_flag(p, "--prefix-groups", type=int, default=4, help="shared-prefix: number of distinct system prompts")
    add_flag(p, "--prefix-len", type=int, default=512, help="shared-prefix: words in each shared system prompt")
    add_flag(p, "--turns", type=int, default=4, help="multi-turn: turns per conversation")
    add_flag(p, "--burstiness", type=float, default=1.0,
             help="gamma shape of inter-arrival gaps: 1 is Poisson, < 1 burstier, > 1 more regular")
    add_flag(p, "--max-concurrency", type=int, default=None,
             help="at most this many requests in flight (with --request-rate inf: a closed loop of this size)")
    add_flag(p, "--num-warmups", type=int, default=1,
             help="requests sent one at a time before measuring (not counted), so that a fresh server's "
                  "one-off start-up costs do not count as latency")
    add_flag(p, "--goodput", nargs="+", default=None, metavar="KEY:MS",
             help="SLOs for goodput, in ms, e.g. --goodput ttft:1000 tpot:50 e2e:20000 (keys ttft, tpot, e2e)")
    add_flag(p, "--disable-tqdm", type=bool, help="no progress bar")


def config_from_args(args: argparse.Namespace, base_url: str, request_rate: float,
                     model: Optional[str] = None) -> ServeConfig:
    api_key = resolve_api_key(args.api_key)
    endpoint = EndpointConfig(base_url=base_url, model=model or args.model or first_model(base_url, api_key),
                              endpoint=args.endpoint, api_key=api_key, ignore_eos=not args.no_ignore_eos,
                              temperature=args.temperature, timeout_s=args.request_timeout)
    sharegpt = replace(ShareGPTLike(), input_median=args.sharegpt_input_median,
                      output_median=args.sharegpt_output_median, max_input_len=args.sharegpt_max_input_len,
                      max_output_len=args.sharegpt_max_output_len)
    dataset = DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                            input_len=args.random_input_len, output_len=args.random_output_len,
                            range_ratio=args.random_range_ratio, sharegpt=sharegpt,
                            prefix_groups=args.prefix_groups, prefix_len=args.prefix_len, turns=args.turns)
    load = LoadConfig(request_rate=request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      warmups=args.num_warmups)
    return ServeConfig(endpoint=endpoint, dataset=dataset, load=load, slos_ms=parse_slos(args.goodput),
                       progress=not args.disable_tqdm)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput, goodput)",
        description="Send a generated dataset of streaming requests to an OpenAI-compatible endpoint (tandem, "
                    "vLLM, ...) on a Poisson/gamma schedule or at a fixed concurrency, and report latency "
                    "percentiles, throughput and goodput. With --result-dir, also JSON and PNG plots.")
    add_flag(p, "--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root (ends in /v1)")
    add_flag(p, "--request-rate", type=float, default=math.inf,
             help="mean requests per second of the arrival process; inf sends all requests at once")
    add_flag(p, "--result-dir", default=None,
             help="write results.json (config, per-request records, summary) and PNG plots here")
    add_workload_flags(p)
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, args.base_url, args.request_rate)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run_serve(config)
    print(report.summary_table(result.summary, title=f"Serving benchmark: {config.endpoint.model} "
                                                     f"@ {config.endpoint.base_url}"))
    if args.result_dir:
        paths = report.write_serve_result(result, args.result_dir)
        print("wrote " + ", ".join(paths))
    first_error = next((r.error for r in result.records if not r.success), None)
    if first_error:
        print(f"{result.summary.failed} request(s) failed; the first error: {first_error}", file=sys.stderr)
    return 0 if result.summary.completed else 1
