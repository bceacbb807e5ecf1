"""The Helm chart's PromQL against a live local stack (`tandem up` as real
processes) and a real Prometheus server scraping it.

- Every series any chart expression names (dashboards, prometheus-adapter
  rules, KEDA triggers; every autoscaling signal of every role) is exported by
  the running services after real chat traffic.
- Each role's autoscaling query, as KEDA would run it, returns a number from
  Prometheus, and the per-role signals rise under concurrent streaming load and
  the instantaneous ones fall back when it ends.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.services.common.metrics import HISTOGRAM_NAMES
from tests.support.helm import chart_promql, metric_family, promql_metric_names, render, scaling_queries
from tests.support.prometheus import PrometheusServer
from tests.support.stack import StackOptions, TandemStack, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

# A small KV cache (64 blocks of 16 tokens per engine). With the default one
# (sized from memory) and the default 8192-token step budget, every prompt a
# CPU can take in one step fits that step: the prefill queue only builds
# inside the step's compute, where num_waiting_prompt_tokens does not count
# it, and the default prefill signal would stay 0 however high TTFT climbs.
# With 64 blocks, 24 concurrent chats do not all fit, so requests wait in the
# schedulers, as they do on a saturated GPU.
TANDEM_STACK_OPTIONS = StackOptions(extra_args=("--num-blocks", "64", "--max-model-len", "512"))

# Every autoscaling signal the chart offers, per role (values.yaml lists them).
SIGNALS = {
    "router": ["requests_in_flight"],
    "prefill": ["waiting_prompt_tokens", "ttft_p90"],
    "decode": ["kv_cache_usage", "running_requests", "itl_p90"],
    "kvstore": ["bytes_out_rate"],
}
# Gauges fall back when the load ends; the others are rates or quantiles over
# the chart's rate window (2m) and keep the load in view for that long.
INSTANTANEOUS = {"requests_in_flight", "waiting_prompt_tokens", "kv_cache_usage", "running_requests"}


def signal_values(choice: int, mode: str) -> dict:
    """Chart values that pick each role's `choice`-th signal (the last one when
    a role has fewer) in autoscaling `mode`. kvstore autoscaling needs a shared
    store, hence the Redis URL."""
    values: dict = {"autoscaling": {"mode": mode}, "redis": {"url": "redis://redis.cache.svc:6379/0"}}
    for role, signals in SIGNALS.items():
        values[role] = {"autoscaling": {"enabled": True, "signal": signals[min(choice, len(signals) - 1)]}}
    return values


# Default values and every signal in both autoscaling modes.
VARIANTS = {"default": {}, "metrics-service-monitor": {"metrics": {"serviceMonitor": {"enabled": True}}}}
for _mode in ("keda", "prometheus-adapter"):
    for _choice in range(3):
        VARIANTS[f"{_mode}-{_choice}"] = signal_values(_choice, _mode)

# Counters of events the warm-up traffic cannot cause on a healthy stack. The
# services create their series at the first event, so until then these are
# declared (# TYPE) but have no sample, and the chart's panels on them show no
# data rather than 0.
EVENT_ONLY = {"tandem:num_preemptions_total", "tandem:kv_recompute_fallbacks_total",
              "tandem:kvstore_evictions_total"}

# Long enough (with the chat template) to go over the router's
# --prefill-threshold, so every request passes through the prefill tier.
SYSTEM = "You are a patient teacher who explains things simply, briefly and kindly to curious children. " * 3
TOPICS = ["rain", "the moon", "bread", "a river", "music", "snow", "a bridge", "tea",
          "clouds", "a forest", "the sea", "bees"]

LOAD_CONCURRENCY = 24
LOAD_SECONDS = 25.0
LOAD_MAX_TOKENS = 16


def chat(i: int) -> list[dict]:
    # The request number first: no two load prompts share a prefix block, so
    # every one is real prefill work.
    return [{"role": "system", "content": f"Conversation {i}. {SYSTEM}"},
            {"role": "user", "content": f"In two sentences, what is {TOPICS[i % len(TOPICS)]}?"}]


def send_warmup(stack: TandemStack, n: int) -> None:
    """`n` chats one after another, alternately streamed and not, the first
    one again (prefix-cache hits), and a prompt short enough for the router to
    skip prefill."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    short = client.completions.create(model=stack.model, prompt="Hello", max_tokens=4)
    assert short.choices[0].text
    for i in [*range(n), 0]:
        if i % 2:
            chunks = list(client.chat.completions.create(model=stack.model, messages=chat(i), max_tokens=8,
                                                         stream=True))
            assert any(c.choices and c.choices[0].delta.content for c in chunks)
        else:
            r = client.chat.completions.create(model=stack.model, messages=chat(i), max_tokens=8)
            assert r.choices[0].message.content


# --- fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prometheus(tandem_stack: TandemStack):
    targets: dict[str, list[str]] = {}
    for child in tandem_stack.children:
        targets.setdefault(child["role"], []).append(urlsplit(tandem_stack.metrics_urls[child["name"]]).netloc)
    with PrometheusServer(targets) as prom:
        prom.wait_for_targets_up()
        yield prom


@pytest.fixture(scope="module")
def warmed(tandem_stack: TandemStack, prometheus: PrometheusServer) -> TandemStack:
    """The stack after a few chats that Prometheus saw happen (its rate()s and
    quantiles need samples from before and after them)."""
    send_warmup(tandem_stack, 6)
    return tandem_stack


@pytest.fixture(scope="module")
def queries() -> dict[tuple[str, str], str]:
    """(role, signal) -> the KEDA query of that signal, runnable locally."""
    out = {}
    for choice in range(3):
        for role, expr in scaling_queries(render(signal_values(choice, "keda"))[0]).items():
            out[(role, SIGNALS[role][min(choice, len(SIGNALS[role]) - 1)])] = expr
    assert {role for role, _ in out} == set(SIGNALS), out
    return out


# --- every name the chart queries is exported --------------------------------------------

@dataclass
class Scrape:
    declared: set[str] = field(default_factory=set)  # family names with a # TYPE line
    sampled: set[str] = field(default_factory=set)  # series names with at least one sample


def scrape_all(stack: TandemStack) -> Scrape:
    scrape = Scrape()
    for url in stack.metrics_urls.values():
        text = httpx.get(url, timeout=10).text
        scrape.declared |= {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        for family in text_string_to_metric_families(text):
            scrape.sampled |= {s.name for s in family.samples}
    return scrape


def test_every_chart_metric_is_exported_by_the_running_services(warmed):
    scrape = scrape_all(warmed)
    used: dict[str, set[str]] = {}  # series name -> where the chart uses it
    for variant, values in VARIANTS.items():
        for q in chart_promql(render(values)[0]):
            for name in promql_metric_names(q.runnable()):
                used.setdefault(name, set()).add(q.where)
    assert len(used) > 10, used  # the chart's dashboards alone name many more

    undeclared = {n: sorted(w) for n, w in used.items()
                  if n not in scrape.declared and metric_family(n, HISTOGRAM_NAMES) not in scrape.declared}
    assert not undeclared, f"the chart queries series no running service exports: {undeclared}"
    unsampled = {n: sorted(w) for n, w in used.items() if n not in scrape.sampled and n not in EVENT_ONLY}
    assert not unsampled, (f"the chart queries series the services declare but had no sample of after "
                           f"real traffic: {unsampled}")


# --- Prometheus: the autoscaling queries ----------------------------------------------------

def test_each_scraped_process_labels_its_series_with_its_own_role(warmed, prometheus):
    prometheus.wait_for_value('count({__name__=~"tandem:.+"})')
    pairs = prometheus.query('count by (job, role) ({__name__=~"tandem:.+"})')
    assert {labels["job"] for labels, _ in pairs} == set(SIGNALS)
    assert all(labels["job"] == labels.get("role") for labels, _ in pairs), pairs


def test_each_roles_scaling_query_returns_a_number(warmed, prometheus, queries):
    for (role, signal), expr in sorted(queries.items()):
        value = prometheus.wait_for_value(expr)
        assert value >= 0, (role, signal, expr, value)


@dataclass
class Sampler:
    """Polls every query until stopped; keeps each one's maximum."""

    prometheus: PrometheusServer
    queries: dict[tuple[str, str], str]
    maxima: dict[tuple[str, str], float] = field(default_factory=dict)
    samples: int = 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for key, expr in self.queries.items():
                v = self.prometheus.value(expr)
                if v is not None:
                    self.maxima[key] = max(v, self.maxima.get(key, -math.inf))
            self.samples += 1
            stop.wait(0.25)


async def drive_load(stack: TandemStack, concurrency: int, seconds: float) -> int:
    """`concurrency` clients streaming short chats back to back for `seconds`;
    the number of chats completed. Every chat must succeed."""
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    end = time.monotonic() + seconds
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < end:
            n = 1000 + w * 1000 + i
            stream = await client.chat.completions.create(model=stack.model, messages=chat(n),
                                                          max_tokens=LOAD_MAX_TOKENS, stream=True)
            tokens = [c async for c in stream if c.choices and c.choices[0].delta.content]
            assert tokens, f"chat {n} streamed no content"
            done += 1
            i += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(concurrency))), seconds + 120)
    finally:
        await client.close()
    return done


def test_scaling_signals_rise_under_load_and_settle(warmed, prometheus, queries):
    idle = {key: prometheus.wait_for_value(expr) for key, expr in queries.items()}
    sampler = Sampler(prometheus, queries)
    stop = threading.Event()
    thread = threading.Thread(target=sampler.run, args=(stop,), daemon=True)
    thread.start()
    try:
        completed = asyncio.run(drive_load(warmed, LOAD_CONCURRENCY, LOAD_SECONDS))
        # The last scrape of the load: one interval after it, and one for the query.
        time.sleep(2.5)
    finally:
        stop.set()
        thread.join(30)
    assert completed >= LOAD_CONCURRENCY
    report = {f"{r}/{s}": (idle[(r, s)], sampler.maxima.get((r, s))) for r, s in sorted(queries)}
    print(f"(idle, max under load) per signal, {sampler.samples} samples, {completed} chats: {report}")
    flat = [k for k, (before, peak) in report.items() if peak is None or not peak > before]
    assert not flat, f"signals that did not rise above idle under load (idle, max): {report}; " \
                     f"{sampler.samples} samples, {completed} chats"

    # The instantaneous signals fall back to idle once the stack drains.
    deadline = time.monotonic() + 30
    pending = {k for k in queries if k[1] in INSTANTANEOUS}
    while pending and time.monotonic() < deadline:
        pending = {k for k in pending if not prometheus.wait_for_value(queries[k]) <= idle[k] + 1e-9}
        time.sleep(0.5)
    assert not pending, {f"{r}/{s}": (idle[(r, s)], prometheus.value(queries[(r, s)])) for r, s in pending}
