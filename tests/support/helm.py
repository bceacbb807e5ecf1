"""Render the Helm chart offline and check what comes out.

Rendering goes through Helm's own Go engine (helm-python-sdk wraps Helm v4's
SDK), so no helm binary is needed. The helpers here are shared by the chart's
unit tests and the live-scrape test, which checks that the names found by
`chart_promql` are really exported by running services.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "llm"


@dataclass
class Manifest:
    template: str  # e.g. tandem/templates/decode.yaml
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def name(self) -> str:
        return self.doc["metadata"]["name"]

    @property
    def role(self) -> Optional[str]:
        return self.doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def render(values: Optional[dict[str, Any]] = None) -> tuple[list[Manifest], str]:
    """The chart's manifests for `values`, and its rendered NOTES.txt."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests, notes = [], ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                manifests.append(Manifest(path, doc))
    return manifests, notes


def by_kind(manifests: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {m.name: m for m in manifests if m.kind == kind}


def container(deployment: Manifest) -> dict:
    (c,) = deployment.doc["spec"]["template"]["spec"]["containers"]
    return c


def env_of(deployment: Manifest) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(deployment)["env"]}


def role_parser(role: str) -> argparse.ArgumentParser:
    """The parser `tandem serve ROLE` runs in the pod."""
    module = importlib.import_module(f"tandem.services.{role}.server")
    parser = argparse.ArgumentParser(prog=f"tandem serve {role}")
    module.add_arguments(parser)
    return parser


# --- PromQL ------------------------------------------------------------------------

_TOKENS = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])                 # [5m], [$__rate_interval]
  | (?P<template><<\.\w+>>)               # prometheus-adapter placeholders
  | (?P<variable>\$\{?\w+\}?)             # Grafana variables
  | (?P<duration>\d+(?:ms|[smhdwy])\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[{}(),])
  | (?P<op>[-+*/%^=!<>~]+)
  | (?P<space>\s+)
""", re.X)

# Words that are PromQL syntax, not series.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "start", "end"}
# Keywords whose parenthesised list names labels, not series.
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def promql_metric_names(expr: str) -> set[str]:
    """Series names an expression selects (bare names and __name__ matchers).

    Raises ValueError on text the tokenizer does not understand, so an
    unusual expression fails loudly instead of passing unchecked.
    """
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKENS.match(expr, pos)
        if not m:
            raise ValueError(f"cannot tokenize PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))

    names: set[str] = set()
    i, in_braces = 0, False
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "{":
            in_braces = True
        elif text == "}":
            in_braces = False
        elif in_braces:
            # Label matchers; only __name__="x" names a series.
            if kind == "ident" and text == "__name__" and nxt == "=" and i + 2 < len(tokens):
                names.add(tokens[i + 2][1][1:-1])
        elif kind == "ident" and text in _LABEL_LISTS and nxt == "(":
            i = tokens.index(("punct", ")"), i)  # skip the label list
        elif kind == "ident" and nxt not in ("(", "by", "without") and text not in _KEYWORDS \
                and text not in _LABEL_LISTS:
            # A name before "(" is a function, before by/without an aggregation.
            names.add(text)
        i += 1
    return names


def metric_family(series: str, histograms: frozenset[str]) -> str:
    """`x_bucket`, `x_sum`, `x_count` of a histogram x -> x; other names unchanged."""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and series[: -len(suffix)] in histograms:
            return series[: -len(suffix)]
    return series


def _adapter_expr(rule: dict[str, Any]) -> str:
    """A prometheus-adapter metricsQuery with its placeholders filled as the
    adapter would: the series the rule discovered, matchers, group-by."""
    series = sorted(promql_metric_names(rule["seriesQuery"]))
    if len(series) != 1:
        raise ValueError(f"adapter rule must discover one series, got {series}: {rule}")
    return (rule["metricsQuery"].replace("<<.Series>>", series[0])
            .replace("<<.LabelMatchers>>", 'namespace="llm"').replace("<<.GroupBy>>", "pod"))


@dataclass
class Query:
    where: str  # what the expression belongs to, for failure messages
    expr: str
    role: Optional[str] = None  # the role whose scaling it drives, if any

    def runnable(self) -> str:
        """The expression with Grafana's variables filled in as "All" does."""
        return (self.expr.replace("$__rate_interval", "1m")
                .replace("$namespace", ".*").replace("$model", ".*"))


def _dashboard_exprs(name: str, dashboard: dict[str, Any]) -> Iterator[Query]:
    def walk(node: Any) -> Iterator[dict[str, Any]]:
        if isinstance(node, dict):
            yield node
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    for panel in walk(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            yield Query(f"dashboard {name} panel {panel.get('title')!r}", target["expr"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            # label_values(series, label): only the first argument is a series.
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query.strip())
            yield Query(f"dashboard {name} variable {var['name']}", m.group(1) if m else query)


def chart_promql(manifests: list[Manifest]) -> list[Query]:
    """Every PromQL expression the chart ships: dashboards, prometheus-adapter
    rules and KEDA triggers."""
    queries: list[Query] = []
    for m in manifests:
        if m.kind == "ConfigMap" and "grafana_dashboard" in m.doc["metadata"].get("labels", {}):
            for key, text in m.doc["data"].items():
                queries.extend(_dashboard_exprs(key, json.loads(text)))
        elif m.kind == "ConfigMap" and "config.yaml" in m.doc.get("data", {}):
            config = yaml.safe_load(m.doc["data"]["config.yaml"])
            for section in ("rules", "externalRules"):
                for rule in config.get(section) or []:
                    role = re.search(r'role="(\w+)"', rule["metricsQuery"])
                    where = f"adapter rule {rule['name']['as']}"
                    queries.append(Query(where, rule["seriesQuery"], role and role.group(1)))
                    queries.append(Query(where, _adapter_expr(rule), role and role.group(1)))
        elif m.kind == "ScaledObject":
            for trigger in m.doc["spec"]["triggers"]:
                queries.append(Query(f"ScaledObject {m.name}", trigger["metadata"]["query"], m.role))
    return queries


def adapter_rules(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    """prometheus-adapter rules by the metric name they serve."""
    rules: dict[str, dict[str, Any]] = {}
    for m in manifests:
        if m.kind == "ConfigMap" and "config.yaml" in m.doc.get("data", {}):
            config = yaml.safe_load(m.doc["data"]["config.yaml"])
            for section in ("rules", "externalRules"):
                for rule in config.get(section) or []:
                    rules[rule["name"]["as"]] = dict(rule, section=section)
    return rules


# --- Kubernetes API types ------------------------------------------------------------

# Core kinds the chart renders and the kubernetes client's model of each.
MODELS = {
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
}

_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
    "datetime": (str,), "date": (str,), "bytes": (str,),
}


def schema_errors(data: Any, type_name: str, path: str = "") -> list[str]:
    """Fields of `data` that the kubernetes client's model `type_name` does not
    know, and values of the wrong type. (The client's own deserializer drops
    unknown fields silently, which would hide a misspelt key.)"""
    from kubernetes import client

    if type_name == "object":  # IntOrString, Quantity, free-form: any JSON value
        return []
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name]) and not (
            type_name != "bool" and isinstance(data, bool))
        return [] if ok else [f"{path}: {data!r} is not {type_name}"]
    # Type names are spelt list[X]/dict(str, X) or List[X]/Dict[str, X]
    # depending on the client's version.
    m = re.fullmatch(r"[lL]ist\[(.+)\]", type_name)
    if m:
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(data) for e in schema_errors(v, m.group(1), f"{path}[{i}]")]
    m = re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name)
    if m:
        if not isinstance(data, dict):
            return [f"{path}: expected a map"]
        value_type = m.group(1) or m.group(2)
        return [e for k, v in data.items() for e in schema_errors(v, value_type, f"{path}.{k}")]
    model = getattr(client.models, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name})"]
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: unknown field of {type_name}")
        elif value is not None:
            errors.extend(schema_errors(value, model.openapi_types[by_json[key]], f"{path}.{key}"))
    return errors


def to_model(doc: dict[str, Any]) -> Any:
    """Build the kubernetes client's model object, as if the API server had
    sent `doc`. Raises ValueError on unknown fields, wrong types and missing
    required fields (the client's pydantic models check the last two), and
    KeyError for a kind with no model here."""
    from kubernetes import client

    type_name = MODELS[(doc["apiVersion"], doc["kind"])]
    errors = schema_errors(doc, type_name, doc["kind"])
    if errors:
        raise ValueError("; ".join(errors))
    api = client.ApiClient()
    if "content_type" in inspect.signature(api.deserialize).parameters:
        return api.deserialize(json.dumps(doc), type_name, "application/json")
    return api.deserialize(_Response(doc), type_name)  # clients before the pydantic models


class _Response:
    """What older clients' ApiClient.deserialize reads: JSON in `.data`."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.data = json.dumps(doc)


def scaling_queries(manifests: list[Manifest]) -> dict[str, str]:
    """role -> the PromQL of its KEDA trigger (render with autoscaling.mode=keda),
    without the namespace matcher, so it runs against a Prometheus that scrapes
    a local stack (whose series have no namespace label)."""
    queries = {}
    for m in manifests:
        if m.kind == "ScaledObject" and m.role:
            (trigger,) = m.doc["spec"]["triggers"]
            queries[m.role] = re.sub(r',namespace="[^"]*"', "", trigger["metadata"]["query"])
    return queries
