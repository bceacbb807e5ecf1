"""Prometheus metrics of every tandem role, defined once.

All series live in prometheus-client's default registry so any role can
expose them: gRPC roles (prefill, decode, kvstore) call
`start_metrics_server(port, host=...)`; the router returns `metrics_response()` from its
FastAPI `/metrics` route.

Every metric carries a `role` label; all but the kvstore ones also carry
`model`.

Exposition is always the classic text format 0.0.4, whatever the scraper's
Accept header asks for: every Prometheus version parses it, while
prometheus-client's OpenMetrics writer (as of 0.26) turns the colons of
sample names into underscores unless the scraper asks for UTF-8 names, which
Prometheus 2.x does not: `tandem:x_total` would arrive as `tandem_x_total`.

The Helm chart's dashboards, HPA rules and KEDA triggers name only
series in `ALL_METRIC_NAMES`, which tests/unit/test_helm_chart.py checks.

prometheus-client appends `_total` to counters itself, so Counter objects are
created without it: the exposed name is then exactly the one in the docs.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

# Latency buckets (seconds). TTFT spans a cached short prompt (ms) to a long
# prefill behind a queue (tens of s); ITL/TPOT a fast decode step (ms) to a
# stalled one (s); e2e covers whole generations up to minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
               0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A KV transfer moves a few KiB to a few hundred MiB over loopback or the
# cluster network: sub-ms to a few s.
TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

ENGINE = ("role", "model")  # label names of every engine-role metric

# --- engine roles (prefill, decode) -----------------------------------------
NUM_REQUESTS_RUNNING = Gauge(
    "tandem:num_requests_running", "Requests in the running batch.", ENGINE)
NUM_REQUESTS_WAITING = Gauge(
    "tandem:num_requests_waiting", "Requests queued, not yet scheduled.", ENGINE)
NUM_WAITING_PROMPT_TOKENS = Gauge(
    "tandem:num_waiting_prompt_tokens",
    "Prompt tokens of queued requests still to be computed (prefill's load signal).", ENGINE)
KV_CACHE_USAGE_PERC = Gauge(
    "tandem:kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 0..1.", ENGINE)
KV_CACHE_FREE_BLOCKS = Gauge(
    "tandem:kv_cache_free_blocks",
    "KV-cache blocks no request holds (cached prefixes count as free: they are reused or evicted "
    "on demand). Back at kv_cache_total_blocks when idle; lower means a request holds blocks.",
    ENGINE)
KV_HELD_BLOCKS = Gauge(
    "tandem:kv_held_blocks",
    "Direct KV transfer, prefill: blocks of finished prompts kept for a decode to copy. Back at 0 "
    "when idle; holds the router never releases end after --kv-hold-timeout.", ENGINE)
KV_CACHE_TOTAL_BLOCKS = Gauge(
    "tandem:kv_cache_total_blocks", "KV-cache blocks this engine can hand out.", ENGINE)
REQUESTS_REJECTED = Counter(
    "tandem:requests_rejected",
    "Requests refused with RESOURCE_EXHAUSTED because the queue was full (back-pressure).", ENGINE)

PREFIX_CACHE_QUERIES = Counter(
    "tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ENGINE)
PREFIX_CACHE_HITS = Counter(
    "tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.", ENGINE)
PROMPT_TOKENS = Counter(
    "tandem:prompt_tokens", "Prompt tokens processed.", ENGINE)
GENERATION_TOKENS = Counter(
    "tandem:generation_tokens", "Tokens generated.", ENGINE)
NUM_PREEMPTIONS = Counter(
    "tandem:num_preemptions", "Requests preempted for lack of KV blocks.", ENGINE)
KV_ADMISSIONS_DEFERRED = Counter(
    "tandem:kv_admissions_deferred",
    "Times a waiting request stayed waiting because the KV blocks it and the running requests "
    "are projected to hold until they finish would not fit the cache (--admission reserve).", ENGINE)
KV_ADMISSIONS_TAIL = Counter(
    "tandem:kv_admissions_tail",
    "Waiting requests admitted past the projection because everything still waiting fit in "
    "--admission-tail's share of the cache (a burst's short tail, which held back would decode alone).",
    ENGINE)
KV_SWAPPED_OUT_BLOCKS = Counter(
    "tandem:kv_swapped_out_blocks",
    "KV blocks of preempted requests copied to the host tier (--swap-space) instead of dropped.", ENGINE)
KV_SWAPPED_IN_BLOCKS = Counter(
    "tandem:kv_swapped_in_blocks",
    "KV blocks of preempted requests copied back from the host tier when they resumed.", ENGINE)
KV_HOST_OFFLOADED_BLOCKS = Counter(
    "tandem:kv_host_offloaded_blocks",
    "Prefix-cache blocks the device cache evicted and the host tier kept.", ENGINE)
KV_HOST_HIT_BLOCKS = Counter(
    "tandem:kv_host_hit_blocks",
    "Prompt KV blocks restored from the host tier by their hash instead of computed.", ENGINE)
SPEC_DECODE_NUM_DRAFTS = Counter(
    "tandem:spec_decode_num_drafts",
    "Speculative decoding: decode steps of a request that carried draft tokens to verify.", ENGINE)
SPEC_DECODE_NUM_DRAFT_TOKENS = Counter(
    "tandem:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed and verified.", ENGINE)
SPEC_DECODE_NUM_ACCEPTED_TOKENS = Counter(
    "tandem:spec_decode_num_accepted_tokens",
    "Speculative decoding: draft tokens the target model accepted (acceptance rate: this / "
    "num_draft_tokens).", ENGINE)
SPEC_DECODE_NUM_EMITTED_TOKENS = Counter(
    "tandem:spec_decode_num_emitted_tokens",
    "Speculative decoding: tokens the verifying steps added to their requests, accepted drafts plus the "
    "target's own token, less what a stop cut (tokens per step: this / num_drafts).", ENGINE)
SPEC_DECODE_GOVERNED_STEPS = Counter(
    "tandem:spec_decode_governed_steps",
    "Speculative decoding, adaptive: decode steps by the policy the governor chose for them (speculate: "
    "drafts proposed where found; plain: no proposal), from the decode speed each measured at the batch's "
    "size.", ENGINE + ("policy",))
SPEC_DECODE_GOVERNOR_CHANGES = Counter(
    "tandem:spec_decode_governor_changes",
    "Speculative decoding, adaptive: times a batch size's policy changed (speculate to plain or back).", ENGINE)
PROMPT_TOKENS_BY_SOURCE = Counter(
    "tandem:prompt_tokens_by_source",
    "Prompt tokens by where their KV came from: local_compute, local_cache_hit, external_kv_transfer.",
    ENGINE + ("source",))
REQUEST_SUCCESS = Counter(
    "tandem:request_success", "Requests finished, by finished_reason.",
    ENGINE + ("finished_reason",))

TIME_TO_FIRST_TOKEN = Histogram(
    "tandem:time_to_first_token_seconds", "Time from arrival to first token.",
    ENGINE, buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram(
    "tandem:inter_token_latency_seconds", "Time between consecutive output tokens.",
    ENGINE, buckets=ITL_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "tandem:time_per_output_token_seconds",
    "Per request: (e2e - TTFT) / (output tokens - 1).", ENGINE, buckets=ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram(
    "tandem:e2e_request_latency_seconds", "Time from arrival to the last token.",
    ENGINE, buckets=E2E_BUCKETS)
REQUEST_QUEUE_TIME = Histogram(
    "tandem:request_queue_time_seconds", "Time a request waited before first scheduled.",
    ENGINE, buckets=QUEUE_BUCKETS)

# --- KV transfer (engine roles <-> kvstore) ----------------------------------
KV_TRANSFER_BYTES = Counter(
    "tandem:kv_transfer_bytes", "KV bytes moved to/from the kvstore.",
    ENGINE + ("direction",))
KV_TRANSFER_BLOCKS = Counter(
    "tandem:kv_transfer_blocks", "KV blocks moved to/from the kvstore.",
    ENGINE + ("direction",))
KV_TRANSFER_SECONDS = Histogram(
    "tandem:kv_transfer_seconds", "Duration of one KV save or load.",
    ENGINE + ("direction",), buckets=TRANSFER_BUCKETS)
KV_TRANSFER_PHASE_SECONDS = Counter(
    "tandem:kv_transfer_phase_seconds",
    "Seconds KV transfers spent in each phase (engine/connector/base.py KV_PHASES names them); "
    "divided by tandem:kv_transfer_phases_total, the mean of one.", ENGINE + ("phase",))
KV_TRANSFER_PHASES = Counter(
    "tandem:kv_transfer_phases", "Runs of each KV transfer phase.", ENGINE + ("phase",))
KV_RECOMPUTE_FALLBACKS = Counter(
    "tandem:kv_recompute_fallbacks",
    "Requests whose KV could not be loaded and were recomputed locally.", ENGINE)
KV_STORE_WRITE_WAIT_SECONDS = Counter(
    "tandem:kv_store_write_wait_seconds",
    "Seconds decode requests waited for blocks their prefill was still writing to the kvstore.", ENGINE)
KV_STORE_WRITE_WAIT_TIMEOUTS = Counter(
    "tandem:kv_store_write_wait_timeouts",
    "Requests that stopped waiting for their prefill's kvstore writes (what had not landed is recomputed).",
    ENGINE)
KV_STORE_LENT_BLOCKS = Counter(
    "tandem:kv_store_lent_blocks",
    "KV blocks copied straight between the cache and the kvstore's own memory (lent slots, same host), "
    "by direction; the rest of kv_transfer_blocks went through the staging arena.", ENGINE + ("direction",))

# --- router ------------------------------------------------------------------
ROUTER_REQUESTS = Counter(
    "tandem:router_requests",
    "Requests answered by the router, by status (HTTP code or gRPC code name).",
    ENGINE + ("status",))
ROUTER_BACKEND_FAILURES = Counter(
    "tandem:router_backend_failures",
    "Calls to a backend instance that failed and took it out of the pool, by tier and instance.",
    ENGINE + ("target_role", "backend"))
ROUTER_INSTANCE_ERRORS = Counter(
    "tandem:router_instance_errors",
    "Calls to an instance that failed for the instance's sake, by tier and outcome: retried (the "
    "request never reached an engine there: refused, draining, dead, and went to another "
    "instance) or failed (an engine took the request and failed on it: not sent on).",
    ENGINE + ("target_role", "outcome"))
ROUTER_HEALTHY_INSTANCES = Gauge(
    "tandem:router_healthy_instances", "Backend instances passing health checks, per tier.",
    ENGINE + ("target_role",))
ROUTER_ROUTING_DECISIONS = Counter(
    "tandem:router_routing_decisions", "Requests sent to each backend instance.",
    ENGINE + ("target_role", "backend"))
ROUTER_PREFILL_SKIPPED = Counter(
    "tandem:router_prefill_skipped",
    "Requests sent straight to decode without a prefill hop.", ENGINE)
ROUTER_REQUESTS_IN_FLIGHT = Gauge(
    "tandem:router_requests_in_flight", "Requests the router is serving now.", ENGINE)
ROUTER_TIME_TO_FIRST_TOKEN = Histogram(
    "tandem:router_time_to_first_token_seconds", "TTFT as seen by the router's client.",
    ENGINE, buckets=TTFT_BUCKETS)
ROUTER_E2E_REQUEST_LATENCY = Histogram(
    "tandem:router_e2e_request_latency_seconds", "End-to-end latency as seen by the client.",
    ENGINE, buckets=E2E_BUCKETS)
ROUTER_INTER_TOKEN_LATENCY = Histogram(
    "tandem:router_inter_token_latency_seconds", "Gap between streamed tokens at the router.",
    ENGINE, buckets=ITL_BUCKETS)

# --- kvstore -----------------------------------------------------------------
KVSTORE = ("role",)
KVSTORE_BYTES = Gauge("tandem:kvstore_bytes", "Bytes of KV held.", KVSTORE)
KVSTORE_BLOCKS = Gauge("tandem:kvstore_blocks", "KV blocks held.", KVSTORE)
KVSTORE_HITS = Counter("tandem:kvstore_hits", "Block lookups that found the block.", KVSTORE)
KVSTORE_MISSES = Counter("tandem:kvstore_misses", "Block lookups that missed.", KVSTORE)
KVSTORE_EVICTIONS = Counter("tandem:kvstore_evictions", "Blocks evicted to stay within capacity.", KVSTORE)
KVSTORE_PUTS = Counter("tandem:kvstore_puts", "Blocks stored.", KVSTORE)
KVSTORE_BYTES_IN = Counter("tandem:kvstore_bytes_in", "Bytes received by puts.", KVSTORE)
KVSTORE_BYTES_OUT = Counter("tandem:kvstore_bytes_out", "Bytes sent by gets.", KVSTORE)
KVSTORE_FRESH_BUFFERS = Counter(
    "tandem:kvstore_fresh_buffers",
    "Values received into memory the store had never used (a page fault per 4 KiB while the bytes come "
    "in), where no ready buffer was left.", KVSTORE)
KVSTORE_COPY_SECONDS = Counter(
    "tandem:kvstore_copy_seconds",
    "Seconds the store spent copying values between engines' shared memory and its own, by clock: wall, "
    "or the copying threads' CPU (wall well above CPU: the copies wait, for the GIL or for memory).",
    KVSTORE + ("clock",))
KVSTORE_COPY_PAGE_FAULTS = Counter(
    "tandem:kvstore_copy_page_faults", "Page faults the store's threads took while copying those values.",
    KVSTORE)
KVSTORE_SHARED_BYTES = Counter("tandem:kvstore_shared_memory_bytes",
                               "Bytes of puts and gets copied through an engine's shared memory (same host) "
                               "instead of the data channel's socket.", KVSTORE)


def _family_name(metric: object) -> str:
    """The series family name as scraped: counters with `_total`."""
    name = metric._name  # type: ignore[attr-defined]
    return name + "_total" if isinstance(metric, Counter) else name


# Every exported family name. Histograms are listed by base name; their
# `_bucket`, `_sum` and `_count` series are implied.
ALL_METRIC_NAMES: frozenset[str] = frozenset(
    _family_name(m) for m in list(globals().values())
    if isinstance(m, (Counter, Gauge, Histogram)))
HISTOGRAM_NAMES: frozenset[str] = frozenset(
    m._name for m in list(globals().values()) if isinstance(m, Histogram))  # type: ignore[attr-defined]


def metrics_response() -> tuple[bytes, str]:
    """(body, content type) for a /metrics route, in text format 0.0.4 (see
    the module docstring for why never OpenMetrics)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_PLAIN_0_0_4


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?")[0] not in ("/", "/metrics"):
            self.send_error(404, "only /metrics is served here")
            return
        body, content_type = metrics_response()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
        pass


def start_metrics_server(port: int, host: str = "0.0.0.0") -> Optional[ThreadingHTTPServer]:
    """Serve /metrics over HTTP on host:port in a daemon thread; port 0
    disables it. Pass the role's --host: under --host 127.0.0.1 metrics must
    not be reachable from other machines either. A port that cannot be bound
    ends the process with one line naming it."""
    if port == 0:
        return None
    try:
        server = ThreadingHTTPServer((host, port), _MetricsHandler)
    except OSError as exc:
        raise SystemExit(
            f"error: cannot serve metrics on {host}:{port}: {exc.strerror or exc}; "
            "pick a free port with --metrics-port, or 0 to turn metrics off") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
