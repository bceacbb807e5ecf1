"""Writes the chart's Grafana dashboards (the *.json next to this file).

The JSON is committed and loaded by templates/dashboards.yaml; edit this file
and run `python helm/tandem/dashboards/generate.py` rather than editing the
JSON by hand. tests/unit/test_helm_chart.py checks that every expression names
only metrics the services export.

The router labels per-instance series `backend` (host:port), not `instance`,
which Prometheus reserves for the scrape target.
"""
import json
from pathlib import Path

out = Path(__file__).resolve().parent
# Every query is narrowed by the dashboard's variables; their "All" value is
# ".*", which also matches series without the label (a Prometheus outside
# Kubernetes has no namespace label).
NS = 'namespace=~"$namespace"'
E = NS + ',model=~"$model"'
R = "$__rate_interval"


def sel(role: str) -> str:
    """Label matchers of one role's series."""
    return "{" + f'role="{role}",' + E + "}"


def q(histogram: str, role: str, quantiles=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    """(expr, legend) of a histogram's quantiles over all of a role's pods."""
    return [(f"histogram_quantile({x}, sum by (le) (rate({histogram}_bucket{sel(role)}[{R}])))",
             f"p{int(x * 100)}") for x in quantiles]


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", desc: str = "") -> dict:
    return {"title": title, "description": desc, "unit": unit, "targets": targets}


def dash(uid: str, title: str, rows: list, model: bool = True) -> dict:
    """A dashboard of rows of time-series panels, three panels a line."""
    panels, y, pid = [], 0, 1
    for row_title, row in rows:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1; y += 1
        for i, p in enumerate(row):
            w = 24 // min(len(row), 3)
            panels.append({
                "id": pid, "type": "timeseries", "title": p["title"], "description": p["description"],
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": w, "x": (i % 3) * w, "y": y + (i // 3) * 8},
                "fieldConfig": {"defaults": {"unit": p["unit"]}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi"}},
                "targets": [{"refId": chr(65 + j), "expr": e, "legendFormat": l,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for j, (e, l) in enumerate(p["targets"])],
            })
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    templ = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
         "current": {}, "hide": 0},
        {"name": "namespace", "type": "query", "label": "Namespace",
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": {"query": "label_values(tandem:router_requests_in_flight, namespace)", "refId": "ns"},
         "definition": "label_values(tandem:router_requests_in_flight, namespace)",
         "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "current": {}, "hide": 0},
    ]
    if model:
        templ.append(
            {"name": "model", "type": "query", "label": "Model",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(tandem:num_requests_running, model)", "refId": "model"},
             "definition": "label_values(tandem:num_requests_running, model)",
             "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "current": {}, "hide": 0})
    return {"uid": uid, "title": title, "tags": ["tandem"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"}, "templating": {"list": templ},
            "annotations": {"list": []}, "panels": panels}

overview = dash("tandem-overview", "tandem / overview", [
    ("Traffic", [
        panel("Requests per second by status", [(f"sum by (status) (rate(tandem:router_requests_total{sel('router')}[{R}]))", "{{status}}")], "reqps",
              "Requests the routers answered, by HTTP status or gRPC code."),
        panel("Requests in flight", [(f"sum(tandem:router_requests_in_flight{sel('router')})", "in flight")], "short",
              "Requests being served across all routers: the router's scaling signal."),
        panel("Tokens per second", [
            (f"sum(rate(tandem:prompt_tokens_total{sel('prefill')}[{R}]))", "prompt (prefill)"),
            (f"sum(rate(tandem:prompt_tokens_total{sel('decode')}[{R}]))", "prompt (decode)"),
            (f"sum(rate(tandem:generation_tokens_total{sel('decode')}[{R}]))", "generated")], "short"),
    ]),
    ("Latency seen by clients", [
        panel("Time to first token", q("tandem:router_time_to_first_token_seconds", "router"), "s"),
        panel("Inter-token latency", q("tandem:router_inter_token_latency_seconds", "router"), "s"),
        panel("End-to-end latency", q("tandem:router_e2e_request_latency_seconds", "router"), "s"),
    ]),
    ("Roles", [
        panel("Pods reporting, by role", [
            (f"count(tandem:router_requests_in_flight{sel('router')})", "router"),
            (f"count by (role) (tandem:num_requests_running{{{E}}})", "{{role}}"),
            (f"count(tandem:kvstore_blocks{{role=\"kvstore\",{NS}}})", "kvstore")], "short",
            "How many pods of each role Prometheus scrapes: follows the autoscalers."),
        panel("Prefill: waiting prompt tokens", [(f"sum(tandem:num_waiting_prompt_tokens{sel('prefill')})", "waiting")], "short",
              "Prompt tokens queued on all prefill pods: the prefill scaling signal."),
        panel("Decode: KV cache usage", [(f"avg(tandem:kv_cache_usage_perc{sel('decode')})", "mean"),
                                         (f"max(tandem:kv_cache_usage_perc{sel('decode')})", "max")], "percentunit",
              "Fraction of KV blocks in use on decode pods: the decode scaling signal."),
        panel("Prompt tokens by source", [(f"sum by (source) (rate(tandem:prompt_tokens_by_source_total{{{E}}}[{R}]))", "{{source}}")], "short",
              "Where prompt KV came from: computed, local prefix cache, or loaded from the KV store."),
        panel("KV transfer throughput", [(f"sum by (direction) (rate(tandem:kv_transfer_bytes_total{{{E}}}[{R}]))", "{{direction}}")], "Bps"),
        panel("Recompute fallbacks per second", [(f"sum(rate(tandem:kv_recompute_fallbacks_total{{{E}}}[{R}]))", "fallbacks")], "short",
              "Requests whose KV could not be loaded and were recomputed on decode: should stay at 0."),
    ]),
])

router = dash("tandem-router", "tandem / router", [
    ("Requests", [
        panel("Requests per second by status", [(f"sum by (status) (rate(tandem:router_requests_total{sel('router')}[{R}]))", "{{status}}")], "reqps"),
        panel("In flight per pod", [(f"sum by (pod) (tandem:router_requests_in_flight{sel('router')})", "{{pod}}")], "short",
              "The router's scaling signal: requests one router serves at once."),
        panel("Prefill skipped per second", [(f"sum(rate(tandem:router_prefill_skipped_total{sel('router')}[{R}]))", "skipped")], "reqps",
              "Short prompts sent straight to decode."),
    ]),
    ("Latency", [
        panel("Time to first token", q("tandem:router_time_to_first_token_seconds", "router"), "s"),
        panel("Inter-token latency", q("tandem:router_inter_token_latency_seconds", "router"), "s"),
        panel("End-to-end latency", q("tandem:router_e2e_request_latency_seconds", "router"), "s"),
    ]),
    ("Routing", [
        panel("Routing decisions per instance", [(f"sum by (target_role, backend) (rate(tandem:router_routing_decisions_total{sel('router')}[{R}]))", "{{target_role}} {{backend}}")], "reqps",
              "How evenly the routing policy spreads requests over instances."),
    ]),
])

def engine(role, title, signal_rows):
    return dash(f"tandem-{role}", title, signal_rows + [
        ("Engine", [
            panel("Requests running / waiting", [(f"sum(tandem:num_requests_running{sel(role)})", "running"),
                                                 (f"sum(tandem:num_requests_waiting{sel(role)})", "waiting")], "short"),
            panel("KV cache usage per pod", [(f"tandem:kv_cache_usage_perc{sel(role)}", "{{pod}}")], "percentunit"),
            panel("Prefix cache hit rate", [(f"sum(rate(tandem:prefix_cache_hits_total{sel(role)}[{R}])) / sum(rate(tandem:prefix_cache_queries_total{sel(role)}[{R}]))", "hit rate")], "percentunit",
                  "Share of looked-up prompt tokens found in the local prefix cache."),
            panel("Queue time", q("tandem:request_queue_time_seconds", role), "s"),
            panel("Preemptions per second", [(f"sum(rate(tandem:num_preemptions_total{sel(role)}[{R}]))", "preemptions"),
                                              (f"sum(rate(tandem:kv_admissions_deferred_total{sel(role)}[{R}]))", "admissions deferred"),
                                              (f"sum(rate(tandem:kv_admissions_tail_total{sel(role)}[{R}]))", "admitted as a tail")], "short",
                  "Requests evicted for lack of KV blocks, times a waiting request stayed waiting because the blocks projected for it and the running requests would not fit (--admission reserve), and requests admitted past that projection as a short tail (--admission-tail); steady preemption or deferral means too few pods."),
            panel("Finished requests per second", [(f"sum by (finished_reason) (rate(tandem:request_success_total{sel(role)}[{R}]))", "{{finished_reason}}")], "reqps"),
        ]),
        ("KV transfer", [
            panel("Bytes per second", [(f"sum by (direction) (rate(tandem:kv_transfer_bytes_total{sel(role)}[{R}]))", "{{direction}}")], "Bps"),
            panel("Blocks per second", [(f"sum by (direction) (rate(tandem:kv_transfer_blocks_total{sel(role)}[{R}]))", "{{direction}}")], "short"),
            panel("Transfer time p90", [(f"histogram_quantile(0.9, sum by (le, direction) (rate(tandem:kv_transfer_seconds_bucket{sel(role)}[{R}])))", "{{direction}}")], "s"),
            panel("Recompute fallbacks per second", [(f"sum(rate(tandem:kv_recompute_fallbacks_total{sel(role)}[{R}]))", "fallbacks")], "short"),
            panel("Waiting for prefill writes", [(f"sum(rate(tandem:kv_store_write_wait_seconds_total{sel(role)}[{R}]))", "seconds waited per second"),
                                                 (f"sum(rate(tandem:kv_store_write_wait_timeouts_total{sel(role)}[{R}]))", "gave up per second")], "short",
                  "Decode requests waiting for blocks their prefill was still writing to the store (it answers before they land)."),
            panel("Where transfer time goes", [(f"sum by (phase) (rate(tandem:kv_transfer_phase_seconds_total{sel(role)}[{R}])) / sum by (phase) (rate(tandem:kv_transfer_phases_total{sel(role)}[{R}]))", "{{phase}}")], "s",
                  "Mean seconds of each phase of a KV transfer (engine/connector/base.py KV_PHASES): slot waits, copies, puts, lookups, loads."),
            panel("Blocks through the store's lent slots", [(f"sum by (direction) (rate(tandem:kv_store_lent_blocks_total{sel(role)}[{R}]))", "{{direction}}")], "short",
                  "Blocks copied straight between the cache and the kvstore's own memory (same host, --kv-store-slots); the rest of the blocks went through the staging arena."),
            panel("Host tier blocks per second", [(f"sum(rate(tandem:kv_swapped_out_blocks_total{sel(role)}[{R}]))", "swapped out"),
                                                  (f"sum(rate(tandem:kv_swapped_in_blocks_total{sel(role)}[{R}]))", "swapped in"),
                                                  (f"sum(rate(tandem:kv_host_hit_blocks_total{sel(role)}[{R}]))", "restored by hash")], "short",
                  "--swap-space: preemption by swapping, and prefix blocks kept in host memory."),
        ]),
    ])

prefill = engine("prefill", "tandem / prefill", [
    ("Scaling signals", [
        panel("Waiting prompt tokens per pod", [(f"sum by (pod) (tandem:num_waiting_prompt_tokens{sel('prefill')})", "{{pod}}")], "short",
              "Prompt tokens queued per prefill pod (signal waiting_prompt_tokens)."),
        panel("Time to first token", q("tandem:time_to_first_token_seconds", "prefill"), "s",
              "TTFT measured on prefill pods (signal ttft_p90 is the p90)."),
        panel("Prompt tokens per second by source", [(f"sum by (source) (rate(tandem:prompt_tokens_by_source_total{sel('prefill')}[{R}]))", "{{source}}")], "short"),
    ]),
])

decode = engine("decode", "tandem / decode", [
    ("Scaling signals", [
        panel("KV cache usage (mean over pods)", [(f"avg(tandem:kv_cache_usage_perc{sel('decode')})", "mean")], "percentunit",
              "Signal kv_cache_usage."),
        panel("Running requests per pod", [(f"sum by (pod) (tandem:num_requests_running{sel('decode')})", "{{pod}}")], "short",
              "Signal running_requests."),
        panel("Inter-token latency", q("tandem:inter_token_latency_seconds", "decode"), "s",
              "Signal itl_p90 is the p90."),
        panel("Time per output token", q("tandem:time_per_output_token_seconds", "decode"), "s"),
        panel("End-to-end latency", q("tandem:e2e_request_latency_seconds", "decode"), "s"),
        panel("Generated tokens per second", [(f"sum(rate(tandem:generation_tokens_total{sel('decode')}[{R}]))", "tokens/s")], "short"),
    ]),
    ("Speculative decoding (--speculative-config)", [
        panel("Draft acceptance rate", [(f"sum(rate(tandem:spec_decode_num_accepted_tokens_total{sel('decode')}[{R}])) / sum(rate(tandem:spec_decode_num_draft_tokens_total{sel('decode')}[{R}]))", "accepted / proposed")], "percentunit",
              "Share of draft tokens the served model accepted."),
        panel("Tokens per verifying step", [(f"sum(rate(tandem:spec_decode_num_emitted_tokens_total{sel('decode')}[{R}])) / sum(rate(tandem:spec_decode_num_drafts_total{sel('decode')}[{R}]))", "tokens per step")], "short",
              "Tokens a request gains per step that verified drafts (1 without speculation)."),
        panel("Draft tokens per second", [(f"sum(rate(tandem:spec_decode_num_draft_tokens_total{sel('decode')}[{R}]))", "proposed"),
                                          (f"sum(rate(tandem:spec_decode_num_accepted_tokens_total{sel('decode')}[{R}]))", "accepted")], "short"),
        panel("Decode steps by the governor's policy", [(f"sum by (policy) (rate(tandem:spec_decode_governed_steps_total{sel('decode')}[{R}]))", "{{policy}}")], "short",
              "Adaptive speculation (the default): steps allowed to speculate against steps kept plain because "
              "plain decoding measured faster at their batch size."),
    ]),
])

K = '{role="kvstore",' + NS + '}'
kvstore = dash("tandem-kvstore", "tandem / kvstore", [
    ("Contents", [
        panel("Bytes held", [(f"sum by (pod) (tandem:kvstore_bytes{K})", "{{pod}}")], "bytes"),
        panel("Blocks held", [(f"sum by (pod) (tandem:kvstore_blocks{K})", "{{pod}}")], "short"),
        panel("Evictions per second", [(f"sum(rate(tandem:kvstore_evictions_total{K}[{R}]))", "evictions")], "short",
              "Blocks dropped to stay in capacity; high rates mean loads will miss."),
    ]),
    ("Traffic", [
        panel("Hit ratio", [(f"sum(rate(tandem:kvstore_hits_total{K}[{R}])) / (sum(rate(tandem:kvstore_hits_total{K}[{R}])) + sum(rate(tandem:kvstore_misses_total{K}[{R}])))", "hit ratio")], "percentunit"),
        panel("Lookups per second", [(f"sum(rate(tandem:kvstore_hits_total{K}[{R}]))", "hits"),
                                     (f"sum(rate(tandem:kvstore_misses_total{K}[{R}]))", "misses")], "short"),
        panel("Puts per second", [(f"sum(rate(tandem:kvstore_puts_total{K}[{R}]))", "puts")], "short"),
        panel("Bytes per second", [(f"sum(rate(tandem:kvstore_bytes_in_total{K}[{R}]))", "in (saves)"),
                                   (f"sum(rate(tandem:kvstore_bytes_out_total{K}[{R}]))", "out (loads)"),
                                   (f"sum(rate(tandem:kvstore_shared_memory_bytes_total{K}[{R}]))", "of which through shared memory")], "Bps",
              "Signal bytes_out_rate is 'out' per pod. Shared memory: engines on the store's host."),
        panel("Copy time per second", [(f"sum by (clock) (rate(tandem:kvstore_copy_seconds_total{K}[{R}]))", "{{clock}}")], "s",
              "Seconds spent copying values through engines' shared memory: wall well above thread_cpu means the copies wait."),
        panel("Fresh value memory per second", [(f"sum(rate(tandem:kvstore_fresh_buffers_total{K}[{R}]))", "fresh values"),
                                                (f"sum(rate(tandem:kvstore_copy_page_faults_total{K}[{R}]))", "page faults while copying")], "short",
              "Values that found no ready slot (the store's slabs are at their limit), and page faults its copies took."),
    ]),
], model=False)

if __name__ == "__main__":
    for name, d in [("overview", overview), ("router", router), ("prefill", prefill),
                    ("decode", decode), ("kvstore", kvstore)]:
        (out / f"{name}.json").write_text(json.dumps(d, indent=2) + "\n")
