"""The chart's engineArgs: each engine role's settings by EngineArgs field
name, turned into their TANDEM_ env twins. The schema lists exactly the
engine flags, so adding a flag without the chart fails here; every value set
reaches the pod and parses to itself with the role's own parser."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the `test` extra)")

import helm_python as helm  # noqa: E402

from tests.support.helm import CHART, NAMESPACE, by_kind, container, env_of, render, role_parser  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# Settings the chart takes elsewhere: every role, the router too, serves `model`
# at one `model.revision` (the router's tokenizer and the engines' weights from one commit).
CHART_OWNED = {"model", "revision"}
SCHEMA_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def engine_args_schema() -> dict:
    """What values.schema.json must say under <role>.engineArgs.properties:
    one entry per engine flag, typed as the flag parses it."""
    from tandem.engine.config import EngineArgs
    from tandem.engine.flags import flag_specs

    props = {}
    for spec in flag_specs(EngineArgs):
        if spec.name in CHART_OWNED:
            continue
        kind = SCHEMA_TYPES[spec.type]
        props[spec.name] = ({"enum": list(spec.choices)} if spec.choices
                            else {"type": [kind, "null"] if spec.optional else kind})
    return props


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_args_in_the_schema_are_exactly_the_engine_flags(role):
    """Adding an EngineArgs flag without the chart fails here."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    section = schema["properties"][role]["properties"]["engineArgs"]
    assert section["additionalProperties"] is False
    expected = engine_args_schema()
    assert section["properties"] == expected, (
        f"helm/tandem/values.schema.json, {role}.engineArgs.properties should be:\n"
        + json.dumps(expected, indent=2))


def _sample(spec):
    """A value other than the default that the flag parses."""
    if spec.type is bool:
        return not spec.default
    if spec.choices:
        return [c for c in spec.choices if c != spec.default][-1]
    return {int: 1000000, float: 0.25, str: "x"}[spec.type]  # 1000000: written as 1e+06 by toString


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_engine_arg_reaches_the_engine_as_set(role, monkeypatch):
    """A value under <role>.engineArgs becomes its env twin in the pod and
    parses, with the role's own parser, to that value."""
    from tandem.engine.config import EngineArgs
    from tandem.engine.flags import flag_specs

    specs = [s for s in flag_specs(EngineArgs) if s.name not in CHART_OWNED | {"kv_transfer", "kv_store"}]
    values = {s.name: _sample(s) for s in specs}
    manifests, _ = render({role: {"engineArgs": values}})
    env = {k: v for k, v in env_of(by_kind(manifests, "Deployment")[f"demo-tandem-{role}"]).items()
           if k.startswith("TANDEM_")}
    for key in list(os.environ):
        if key.startswith("TANDEM_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parsed = EngineArgs.from_cli_args(role_parser(role).parse_args([]))
    assert {name: getattr(parsed, name) for name in values} == values
    assert (parsed.kv_transfer, parsed.kv_store) == ("store", "demo-tandem-kvstore:50081")


def test_engine_args_turn_the_store_off_or_point_elsewhere():
    off = env_of(by_kind(render({"decode": {"engineArgs": {"kv_transfer": "none"}}})[0],
                         "Deployment")["demo-tandem-decode"])
    assert off["TANDEM_KV_TRANSFER"] == "none" and "TANDEM_KV_STORE" not in off
    elsewhere = env_of(by_kind(render({"decode": {"engineArgs": {"kv_store": "store.svc:50081"}}})[0],
                               "Deployment")["demo-tandem-decode"])
    assert elsewhere["TANDEM_KV_STORE"] == "store.svc:50081"


def test_role_env_wins_over_engine_args_which_win_over_global_env():
    manifests, _ = render({"env": {"TANDEM_MAX_NUM_SEQS": 8, "TANDEM_BLOCK_SIZE": 8},
                           "decode": {"engineArgs": {"max_num_seqs": 64, "block_size": 32},
                                      "env": {"TANDEM_BLOCK_SIZE": 64}}})
    env = env_of(by_kind(manifests, "Deployment")["demo-tandem-decode"])
    assert (env["TANDEM_MAX_NUM_SEQS"], env["TANDEM_BLOCK_SIZE"]) == ("64", "64")
    assert [e["name"] for e in container(by_kind(manifests, "Deployment")["demo-tandem-decode"])["env"]
            ].count("TANDEM_BLOCK_SIZE") == 1


@pytest.mark.parametrize("values, message", [
    ({"prefill": {"engineArgs": {"kv_transfer": "direct"}}}, "prefill.engineArgs.kv_transfer=direct needs"),
])
def test_render_refuses_engine_args_a_cluster_cannot_run(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


@pytest.mark.parametrize("values, path", [
    ({"decode": {"engineArgs": {"max_num_seq": 64}}}, "/decode/engineArgs"),
    ({"decode": {"engineArgs": {"model": "other"}}}, "/decode/engineArgs"),
    ({"prefill": {"engineArgs": {"policy": "lifo"}}}, "/prefill/engineArgs/policy"),
])
def test_lint_rejects_unknown_or_bad_engine_args(values, path):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert any(path in m["error"] for m in report["messages"] if m["severity"] == 3), report


def test_a_hub_revision_reaches_every_role_the_router_too():
    """model.revision is chart-wide: the router's tokenizer and the engines'
    weights come from one commit of the Hub repo."""
    manifests, _ = render({"model": {"source": "hub", "name": "org/tiny", "revision": "v2"}})
    deployments = by_kind(manifests, "Deployment")
    for role in ("router", "prefill", "decode"):
        env = env_of(deployments[f"demo-tandem-{role}"])
        assert (env["TANDEM_MODEL"], env["TANDEM_REVISION"]) == ("org/tiny", "v2"), role
