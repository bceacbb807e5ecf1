"""The chart's KV transport: the kvstore's data channel reaches the engines,
and the engines get the shared memory their KV staging arena lives in
(rendered with Helm's own engine, as in test_helm_chart.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the `test` extra)")

from tests.support.helm import by_kind, container, env_of, render  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ROLES = ("router", "prefill", "decode", "kvstore")


@pytest.fixture(scope="module")
def rendered() -> dict:
    return {"default": render({})}


def test_kvstore_exposes_its_data_channel_to_the_engines(rendered):
    # Engines find the data port in the store's Stats and connect to the same
    # Service name: the Service and the container must both carry it.
    manifests, _ = rendered["default"]
    service = by_kind(manifests, "Service")["demo-tandem-kvstore"].doc["spec"]
    assert {"name": "data", "port": 50082} in [{k: p[k] for k in ("name", "port")} for p in service["ports"]]
    kvstore = container(by_kind(manifests, "Deployment")["demo-tandem-kvstore"])
    assert env_of(by_kind(manifests, "Deployment")["demo-tandem-kvstore"])["TANDEM_DATA_PORT"] == "50082"
    assert 50082 in [p["containerPort"] for p in kvstore["ports"]]


def test_engines_get_a_shared_memory_volume_for_their_kv_staging_arena(rendered):
    deployments = by_kind(rendered["default"][0], "Deployment")
    for role in ROLES:
        spec = deployments[f"demo-tandem-{role}"].doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        if role in ("prefill", "decode"):
            assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}, role
            assert mounts["shm"] == "/dev/shm", role
        else:
            assert "shm" not in volumes, role
