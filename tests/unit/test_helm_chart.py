"""The Helm chart, checked with Helm's own Go engine (helm-python-sdk, no helm
binary) and the Kubernetes API types of the `kubernetes` client.

What a cluster would reject, these tests reject: lint findings, unknown or
mistyped fields, missing required fields, Services that select no pods, env
vars no role understands, PromQL naming series no service exports.
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the `test` extra)")
pytest.importorskip("kubernetes", reason="pip install kubernetes (the `test` extra)")

import helm_python as helm  # noqa: E402

from tandem.services.common.metrics import ALL_METRIC_NAMES, HISTOGRAM_NAMES  # noqa: E402
from tests.support.helm import (  # noqa: E402
    CHART, MODELS, NAMESPACE, Manifest, adapter_rules, by_kind, chart_promql, container, env_of,
    metric_family, promql_metric_names, render, role_parser, scaling_queries, to_model,
)

pytestmark = pytest.mark.timeout(120)

ROLES = ("router", "prefill", "decode", "kvstore")

VARIANTS = {
    "default": {},
    "redis": {"redis": {"enabled": True}, "kvstore": {"replicas": 2, "autoscaling": {"enabled": True}},
              "autoscaling": {"mode": "prometheus-adapter"}},
    "redis-external": {"redis": {"url": "redis://redis.cache.svc:6379/3"}},
    "keda": {"autoscaling": {"mode": "keda"},
             "redis": {"url": "redis://redis.cache.svc:6379/0"},
             "kvstore": {"autoscaling": {"enabled": True}},
             "env": {"HF_HUB_OFFLINE": "1"},
             "router": {"env": {"TANDEM_ROUTING": "prefix_affinity"}},
             "prefill": {"autoscaling": {"signal": "ttft_p90", "target": "0.5"},
                         "env": {"TANDEM_MAX_MODEL_LEN": 2048}},
             "decode": {"autoscaling": {"signal": "itl_p90", "target": "0.05"},
                        "env": {"TANDEM_MAX_MODEL_LEN": 2048, "TANDEM_MAX_NUM_SEQS": 64}},
             "metrics": {"serviceMonitor": {"enabled": True}}},
    "prometheus-adapter": {"autoscaling": {"mode": "prometheus-adapter"},
                           "decode": {"autoscaling": {"signal": "running_requests", "target": "32"}}},
    "gpu": {"gpu": {"enabled": True, "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}]},
            "prefill": {"engineArgs": {"max_num_batched_tokens": 16384, "enable_prefix_caching": False}},
            "decode": {"engineArgs": {"gpu_memory_utilization": 0.85, "max_num_seqs": 512}}},
    "pvc-tls-no-prefill": {"model": {"source": "pvc", "path": "llama-3.1-8b",
                                     "pvc": {"claimName": "models"}},
                           "tls": {"enabled": True, "secretName": "tandem-mtls"},
                           "prefill": {"enabled": False},
                           "router": {"service": {"type": "LoadBalancer"}, "apiKeySecret": "tandem-keys"}},
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, tuple[list[Manifest], str]]:
    return {name: render(values) for name, values in VARIANTS.items()}


# --- Helm itself -----------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_strict_lint_passes(variant):
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("values, path", [
    ({"autoscaling": {"mode": "hpa"}}, "/autoscaling/mode"),
    ({"decode": {"replicas": "2"}}, "/decode/replicas"),
    ({"prefill": {"autoscaling": {"signal": "kv_cache_usage"}}}, "/prefill/autoscaling/signal"),
])
def test_lint_reports_values_the_schema_rejects(values, path):
    """Lint can fail. (Like `helm lint`, it only logs a template's `fail`;
    those checks are covered by rendering below.)"""
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert any(path in m["error"] for m in report["messages"] if m["severity"] == 3), report


@pytest.mark.parametrize("values, message", [
    ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
    ({"redis": {"enabled": True, "url": "redis://x:6379/0"}}, "not both"),
    ({"kvstore": {"replicas": 3}}, "needs a Redis backend"),
    ({"kvstore": {"autoscaling": {"enabled": True}}, "autoscaling": {"mode": "keda"}}, "needs a Redis backend"),
    ({"decode": {"autoscaling": {"signal": "gpu_util"}}, "autoscaling": {"mode": "keda"}},
     "decode.autoscaling.signal"),
    ({"tls": {"enabled": True}}, "tls.secretName"),
    ({"autoscaling": {"mode": "hpa"}}, "autoscaling.mode"),
])
def test_render_rejects_inconsistent_values_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


# --- Kubernetes API types --------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifests_are_valid_kubernetes_objects(rendered, variant):
    manifests, _ = rendered[variant]
    assert manifests
    for m in manifests:
        key = (m.doc["apiVersion"], m.kind)
        if key in MODELS:
            to_model(m.doc)  # raises on unknown, mistyped or missing fields
        elif key == ("keda.sh/v1alpha1", "ScaledObject"):
            spec = m.doc["spec"]
            assert spec["scaleTargetRef"]["name"] and spec["triggers"], m.doc
            for t in spec["triggers"]:
                assert t["type"] == "prometheus"
                assert set(t["metadata"]) >= {"serverAddress", "query", "threshold"}
                assert t["metricType"] in ("AverageValue", "Value")
                float(t["metadata"]["threshold"])  # KEDA parses it as a number
        elif key == ("monitoring.coreos.com/v1", "ServiceMonitor"):
            spec = m.doc["spec"]
            assert spec["selector"]["matchLabels"] and spec["endpoints"]
            assert all(e["port"] for e in spec["endpoints"])
        else:
            pytest.fail(f"{m.template} renders {key}, which no check here covers")
        assert len(m.name) <= 63, m.name


def test_schema_check_catches_misspelt_and_missing_fields(rendered):
    """The offline schema check is not a no-op."""
    deployment = by_kind(rendered["default"][0], "Deployment")["demo-tandem-decode"].doc
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(ValueError, match="unknown field"):
        to_model(typo)
    nameless = json.loads(json.dumps(deployment))
    del nameless["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError):
        to_model(nameless)
    port_as_text = json.loads(json.dumps(deployment))
    port_as_text["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "50071"
    with pytest.raises(ValueError):
        to_model(port_as_text)


# --- wiring ----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_service_selects_exactly_its_deployments_pods(rendered, variant):
    manifests, _ = rendered[variant]
    deployments = by_kind(manifests, "Deployment")
    for service in by_kind(manifests, "Service").values():
        selector = service.doc["spec"]["selector"]
        matched = [d for d in deployments.values()
                   if selector.items() <= d.doc["spec"]["template"]["metadata"]["labels"].items()]
        assert [d.name for d in matched] == [service.name], service.name
        (deployment,) = matched
        assert selector.items() <= deployment.doc["spec"]["selector"]["matchLabels"].items()
        port_names = {p["name"] for c in deployment.doc["spec"]["template"]["spec"]["containers"]
                      for p in c["ports"]}
        for port in service.doc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service.name, port)


def test_default_install_runs_every_role_on_cpu_with_memory_store(rendered):
    manifests, notes = rendered["default"]
    deployments = by_kind(manifests, "Deployment")
    assert sorted(deployments) == sorted(f"demo-tandem-{r}" for r in ROLES)
    for d in deployments.values():
        assert "nvidia.com/gpu" not in json.dumps(d.doc), d.name
        assert container(d)["args"][:2] == ["serve", d.role]
    assert env_of(deployments["demo-tandem-kvstore"])["TANDEM_BACKEND"] == "memory"
    # Engines in other pods cannot map the store's /dev/shm: its values stay in private memory.
    assert env_of(deployments["demo-tandem-kvstore"])["TANDEM_NO_SHARED_SLABS"] == "1"
    router = env_of(deployments["demo-tandem-router"])
    assert router["TANDEM_PREFILL"] == "demo-tandem-prefill:50061"
    assert router["TANDEM_DECODE"] == "demo-tandem-decode:50071"
    for role in ("prefill", "decode"):
        env = env_of(deployments[f"demo-tandem-{role}"])
        assert (env["TANDEM_KV_TRANSFER"], env["TANDEM_KV_STORE"]) == ("store", "demo-tandem-kvstore:50081")
    assert "kubectl port-forward" in notes and "svc/demo-tandem-router 8000:8000" in notes
    assert not by_kind(manifests, "HorizontalPodAutoscaler") and not by_kind(manifests, "ScaledObject")


def test_kvstore_is_cluster_internal(rendered):
    for variant, (manifests, _) in rendered.items():
        service = by_kind(manifests, "Service")["demo-tandem-kvstore"].doc["spec"]
        assert service.get("type", "ClusterIP") == "ClusterIP", variant
        assert all("nodePort" not in p for p in service["ports"])


def test_engine_services_are_headless_so_the_router_sees_every_pod(rendered):
    services = by_kind(rendered["default"][0], "Service")
    for role in ("prefill", "decode"):
        assert services[f"demo-tandem-{role}"].doc["spec"]["clusterIP"] == "None"


def test_probes_use_grpc_health_and_router_http_health(rendered):
    deployments = by_kind(rendered["default"][0], "Deployment")
    for role, port in (("prefill", 50061), ("decode", 50071), ("kvstore", 50081)):
        c = container(deployments[f"demo-tandem-{role}"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (role, probe)
    router = container(deployments["demo-tandem-router"])
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["startupProbe"]["httpGet"]["path"] == "/health"


def test_pods_drain_gracefully(rendered):
    for d in by_kind(rendered["default"][0], "Deployment").values():
        spec = d.doc["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 30
        assert spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_gpu_on_gives_engines_gpus_and_leaves_router_and_kvstore_on_cpu(rendered):
    deployments = by_kind(rendered["gpu"][0], "Deployment")
    for role in ROLES:
        d = deployments[f"demo-tandem-{role}"]
        limits = container(d)["resources"]["limits"]
        spec = d.doc["spec"]["template"]["spec"]
        if role in ("prefill", "decode"):
            assert limits["nvidia.com/gpu"] == "1"
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        else:
            assert "nvidia.com/gpu" not in limits and "nodeSelector" not in spec


def test_a_tensor_parallel_engine_gets_a_gpu_per_rank():
    manifests, _ = render({"gpu": {"enabled": True},
                           "decode": {"engineArgs": {"tensor_parallel_size": 4}},
                           "prefill": {"gpus": 8, "engineArgs": {"tensor_parallel_size": 2}}})
    deployments = by_kind(manifests, "Deployment")
    gpus = {role: container(deployments[f"demo-tandem-{role}"])["resources"]["limits"]["nvidia.com/gpu"]
            for role in ("prefill", "decode")}
    assert gpus == {"prefill": "8", "decode": "4"}  # `gpus` where it is more, else one per rank


def test_redis_switches_the_store_backend(rendered):
    manifests, _ = rendered["redis"]
    deployments = by_kind(manifests, "Deployment")
    assert "demo-tandem-redis" in deployments and "demo-tandem-redis" in by_kind(manifests, "Service")
    assert env_of(deployments["demo-tandem-kvstore"])["TANDEM_BACKEND"] == "redis://demo-tandem-redis:6379/0"
    external, _ = rendered["redis-external"]
    assert "demo-tandem-redis" not in by_kind(external, "Deployment")
    kvstore = by_kind(external, "Deployment")["demo-tandem-kvstore"]
    assert env_of(kvstore)["TANDEM_BACKEND"] == "redis://redis.cache.svc:6379/3"


def test_pvc_model_tls_and_no_prefill_tier(rendered):
    manifests, notes = rendered["pvc-tls-no-prefill"]
    deployments = by_kind(manifests, "Deployment")
    assert "demo-tandem-prefill" not in deployments
    router = deployments["demo-tandem-router"]
    assert env_of(router)["TANDEM_PREFILL"] == ""
    for role in ("router", "decode"):
        d = deployments[f"demo-tandem-{role}"]
        env = env_of(d)
        assert env["TANDEM_MODEL"] == "/models/llama-3.1-8b"
        assert env["TANDEM_TLS_CA"] == "/etc/tandem/tls/ca.crt"
        volumes = {v["name"]: v for v in d.doc["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert volumes["tls"]["secret"]["secretName"] == "tandem-mtls"
    kvstore = deployments["demo-tandem-kvstore"]
    assert "TANDEM_MODEL" not in env_of(kvstore)
    # Kubernetes' gRPC probe cannot speak TLS: TCP instead.
    assert container(kvstore)["readinessProbe"] == {"tcpSocket": {"port": 50081}, "periodSeconds": 5,
                                                    "failureThreshold": 2}
    assert "EXTERNAL-IP" in notes
    (api_key,) = [e for e in container(router)["env"] if e["name"] == "TANDEM_API_KEY"]
    assert api_key["valueFrom"] == {"secretKeyRef": {"name": "tandem-keys", "key": "api-keys"}}


@pytest.mark.parametrize("variant", ["default", "redis", "keda", "pvc-tls-no-prefill", "gpu"])
def test_every_role_accepts_the_env_the_chart_sets(rendered, variant, monkeypatch):
    """Each TANDEM_* variable is a real flag's env twin with a value the flag
    parses (the same code path `tandem serve <role>` runs in the pod)."""
    from tandem.services.common.config import env_name

    for d in by_kind(rendered[variant][0], "Deployment").values():
        if d.role not in ROLES:
            continue
        env = {k: v for k, v in env_of(d).items() if k.startswith("TANDEM_")}
        twins = {env_name(opt) for action in role_parser(d.role)._actions
                 for opt in action.option_strings if opt.startswith("--")}
        assert set(env) <= twins, (d.role, sorted(set(env) - twins))
        for key in list(os.environ):
            if key.startswith("TANDEM_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            # From a Secret (valueFrom): any value; the flag exists, checked above.
            monkeypatch.setenv(key, value if value is not None else "secret")
        args = role_parser(d.role).parse_args([])
        assert args.host == "0.0.0.0" and args.port == container(d)["ports"][0]["containerPort"]
        if variant == "keda" and d.role == "decode":  # user env reaches the flags, typed
            assert (args.max_model_len, args.max_num_seqs) == (2048, 64)
            assert env_of(d)["HF_HUB_OFFLINE"] == "1"


# --- metrics and autoscaling -----------------------------------------------------------

def test_promql_tokenizer_finds_series_and_only_series():
    expr = ('histogram_quantile(0.9, sum by (le, pod) (rate(a:b_bucket{role="x",model=~"$m"}'
            '[$__rate_interval]))) / on(pod) group_left sum without (le) (c_total offset 5m)'
            ' + {__name__="d:e",role!=""}')
    assert promql_metric_names(expr) == {"a:b_bucket", "c_total", "d:e"}
    with pytest.raises(ValueError):
        promql_metric_names("rate(x[5m]) # comment")


@pytest.mark.parametrize("variant", ["default", "redis", "keda", "prometheus-adapter"])
def test_every_promql_expression_names_only_exported_metrics(rendered, variant):
    queries = chart_promql(rendered[variant][0])
    assert len(queries) > 50  # dashboards alone have more; an empty scan proves nothing
    for q in queries:
        names = promql_metric_names(q.expr)
        assert names, f"{q.where}: no series in {q.expr!r}"
        unknown = {metric_family(n, HISTOGRAM_NAMES) for n in names} - ALL_METRIC_NAMES
        assert not unknown, f"{q.where}: {sorted(unknown)} not exported (services/common/metrics.py)"


def test_every_promql_expression_parses_with_promtool(rendered, tmp_path):
    """Prometheus' own parser (promtool, from Debian's prometheus package, which
    .ci/run installs) accepts every expression the chart ships."""
    import shutil
    import subprocess

    import yaml

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    queries = [q for v in ("default", "keda", "redis") for q in chart_promql(rendered[v][0])]
    rules = {"groups": [{"name": "tandem-chart", "rules": [
        {"record": f"tandem_check:expr{i}", "expr": q.runnable()} for i, q in enumerate(queries)]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(queries)} rules found" in result.stdout


def test_dashboards_one_per_role_and_an_overview(rendered):
    dashboards = {m.name: m for m in by_kind(rendered["default"][0], "ConfigMap").values()
                  if m.doc["metadata"]["labels"].get("grafana_dashboard") == "1"}
    assert sorted(dashboards) == sorted(f"demo-tandem-dashboard-{d}" for d in (*ROLES, "overview"))
    uids = set()
    for m in dashboards.values():
        (text,) = m.doc["data"].values()
        uids.add(json.loads(text)["uid"])
    assert len(uids) == len(dashboards)


OWN_SIGNAL = {  # which metric families a role may scale on
    "router": lambda n: n.startswith("tandem:router_"),
    "prefill": lambda n: not n.startswith(("tandem:router_", "tandem:kvstore_")),
    "decode": lambda n: not n.startswith(("tandem:router_", "tandem:kvstore_")),
    "kvstore": lambda n: n.startswith("tandem:kvstore_"),
}


def _assert_own_signal(role: str, expr: str) -> None:
    assert f'role="{role}"' in expr, (role, expr)
    for name in promql_metric_names(expr):
        assert OWN_SIGNAL[role](name), (role, expr)


@pytest.mark.parametrize("variant", ["keda", "redis", "prometheus-adapter"])
def test_each_role_scales_on_its_own_signal(rendered, variant):
    manifests, _ = rendered[variant]
    scalers = by_kind(manifests, "ScaledObject") or by_kind(manifests, "HorizontalPodAutoscaler")
    expected = {"router", "prefill", "decode"} | ({"kvstore"} if variant in ("redis", "keda") else set())
    assert {s.role for s in scalers.values()} == expected
    rules = adapter_rules(manifests)
    deployments = by_kind(manifests, "Deployment")
    for s in scalers.values():
        target = s.doc["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and deployments[target["name"]].role == s.role
        assert "replicas" not in deployments[target["name"]].doc["spec"]  # the scaler owns it
        if s.kind == "ScaledObject":
            for trigger in s.doc["spec"]["triggers"]:
                _assert_own_signal(s.role, trigger["metadata"]["query"])
        else:
            for metric in s.doc["spec"]["metrics"]:
                spec = metric[metric["type"].lower()]
                rule = rules[spec["metric"]["name"]]  # the adapter serves this metric
                assert rule["section"] == ("rules" if metric["type"] == "Pods" else "externalRules")
                _assert_own_signal(s.role, rule["metricsQuery"])


def test_keda_latency_signals_use_the_role_wide_quantile(rendered):
    scaled = by_kind(rendered["keda"][0], "ScaledObject")
    prefill = scaled["demo-tandem-prefill"].doc["spec"]["triggers"][0]
    assert prefill["metricType"] == "Value"
    assert "tandem:time_to_first_token_seconds_bucket" in prefill["metadata"]["query"]
    decode = scaled["demo-tandem-decode"].doc["spec"]["triggers"][0]
    assert "tandem:inter_token_latency_seconds_bucket" in decode["metadata"]["query"]
    router = scaled["demo-tandem-router"].doc["spec"]["triggers"][0]
    assert router["metricType"] == "AverageValue"
    assert "tandem:router_requests_in_flight" in router["metadata"]["query"]
    local = scaling_queries(rendered["keda"][0])
    assert local["router"] == 'sum(tandem:router_requests_in_flight{role="router"})'


def test_service_monitor_scrapes_every_role(rendered):
    manifests, _ = rendered["keda"]
    (monitor,) = by_kind(manifests, "ServiceMonitor").values()
    ports = {e["port"] for e in monitor.doc["spec"]["endpoints"]}
    for service in by_kind(manifests, "Service").values():
        if service.role in ROLES:
            assert ports & {p["name"] for p in service.doc["spec"]["ports"]}, service.name


def test_metrics_endpoint_keeps_the_names_the_chart_queries():
    """A scrape with Prometheus 2.x's Accept header (which prefers OpenMetrics)
    gets every family under the exact name the dashboards and autoscalers use."""
    import urllib.request

    from tandem.services.common import metrics
    from tests.support.ports import free_port, wait_for_port

    metrics.KVSTORE_PUTS.labels(role="kvstore").inc()
    metrics.TIME_TO_FIRST_TOKEN.labels(role="prefill", model="m").observe(0.2)
    metrics.ROUTER_REQUESTS_IN_FLIGHT.labels(role="router", model="m").set(0)
    port = free_port()
    metrics.start_metrics_server(port, host="127.0.0.1")
    wait_for_port(port)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                  "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    typed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert typed >= metrics.ALL_METRIC_NAMES  # histograms by base name, counters with _total
    assert 'tandem:kvstore_puts_total{role="kvstore"}' in text
    assert 'tandem:time_to_first_token_seconds_bucket{le="0.25",model="m",role="prefill"} 1.0' in text
    body, content_type = metrics.metrics_response()
    assert b"tandem:router_requests_in_flight" in body and "0.0.4" in content_type
