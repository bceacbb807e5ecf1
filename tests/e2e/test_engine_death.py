"""An engine whose loop dies never looks healthy: its gRPC health turns
NOT_SERVING at once and the process exits with status 3; the request it was
running gets 503 with Retry-After (and is not sent to the other instance);
the router's pool, /health and metrics show the instance gone within two
health intervals; `tandem up` restarts it and it serves again.

The loop is killed with the engine's test-only fault hook
(TANDEM_FAULT_HOOKS=1: SIGUSR1 makes the loop raise, as a real failure would)."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tandem.services.common.grpc_server import make_channel
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.support.stack import StackOptions, TandemStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

HEALTH_INTERVAL_S = 1.0  # the router's --health-interval default
OPTIONS = StackOptions(prefill=1, decode=2, private=True, when_child_exits="restart",
                       env=(("TANDEM_FAULT_HOOKS", "1"),))


@pytest.fixture(scope="module")
def stack():
    stack = TandemStack(OPTIONS)
    try:
        yield stack.start()
    finally:
        stack.stop()


def _load(address: str) -> common_pb2.Load:
    channel = make_channel(address)
    try:
        return decode_pb2_grpc.DecodeServiceStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
    finally:
        channel.close()


def _decode_health(stack: TandemStack) -> tuple[int, float]:
    """Healthy decode instances by the router's /health and by its metric."""
    health = httpx.get(f"{stack.http_url}/health", timeout=5).json()["instances"]["decode"]["healthy"]
    gauge = stack.metric("router", "tandem:router_healthy_instances", target_role="decode")
    return health, gauge


def test_a_dead_engine_leaves_the_pool_fails_its_request_and_comes_back(stack):
    decodes = [c for c in stack.children if c["role"] == "decode"]
    result: dict = {}

    def long_request() -> None:
        result["response"] = httpx.post(f"{stack.base_url}/chat/completions", timeout=300, json={
            "model": stack.model, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count to a thousand."}]})

    client = threading.Thread(target=long_request)
    client.start()
    deadline = time.monotonic() + 60
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, "the request never started on a decode instance"
        victim = next((c for c in decodes if _load(c["address"]).num_running == 1), None)
        time.sleep(0.1)
    other = next(c for c in decodes if c is not victim)
    routed_to_other = stack.metric("router", "tandem:router_routing_decisions_total", backend=other["address"])

    os.kill(victim["pid"], signal.SIGUSR1)
    killed_at = time.monotonic()
    while _decode_health(stack) != (1, 1.0):
        assert time.monotonic() - killed_at < 2 * HEALTH_INTERVAL_S, _decode_health(stack)
        time.sleep(0.05)

    client.join(60)
    response = result["response"]
    assert response.status_code == 503, response.text
    assert response.headers.get("retry-after") == "1"
    assert "engine failed" in response.json()["error"]["message"]
    # Not sent on: the other instance never saw it.
    assert stack.metric("router", "tandem:router_routing_decisions_total",
                        backend=other["address"]) == routed_to_other
    assert stack.metric("router", "tandem:router_instance_errors_total", target_role="decode",
                        outcome="failed") == 1

    restarted = stack.wait_restarted(victim["name"], victim["pid"])
    log = stack.launcher_log(None)
    assert f"{victim['name']} (pid {victim['pid']}) exited with code 3; restarting" in log
    assert restarted["address"] == victim["address"]
    deadline = time.monotonic() + 30
    while _decode_health(stack) != (2, 2.0):
        assert time.monotonic() < deadline, _decode_health(stack)
        time.sleep(0.2)
    channel = make_channel(victim["address"])
    try:
        replies = list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(
            request_id="after-restart", prompt_token_ids=[1, 2, 3],
            params=common_pb2.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)), timeout=60))
    finally:
        channel.close()
    assert sum(len(r.token_ids) for r in replies) == 3
