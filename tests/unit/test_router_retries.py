"""The router sends a request to another instance only when it never reached
an engine: an instance that refuses (unreachable, draining, its engine dead,
its queue full) is skipped, while a request an engine took in and failed on
ends there (503 for an engine failure, 400 for a bad request), so one
poisonous request costs one engine at most. Real gRPC servers on loopback
play the instances; `tandem:router_instance_errors_total` counts both cases."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from tandem.services.common.aio_server import start_aio_grpc_server
from tandem.services.common.engine_protocol import ADMITTED_METADATA
from tandem.services.router.backends import BackendPool
from tandem.services.router.dispatch import DispatchError, Dispatcher
from tandem.services.router.telemetry import RouterTelemetry
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "retry-test-model"


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    """fail: None (serve), or (gRPC code, admitted first?)."""

    def __init__(self, fail=None) -> None:
        self.fail = fail
        self.calls = 0

    async def GetLoad(self, request, context) -> common_pb2.Load:
        return common_pb2.Load(num_total_blocks=8, num_free_blocks=8)

    async def Decode(self, request, context):
        self.calls += 1
        if self.fail is not None:
            code, admitted = self.fail
            if admitted:
                await context.send_initial_metadata(ADMITTED_METADATA)
            await context.abort(code, "the test says so")
        await context.send_initial_metadata(ADMITTED_METADATA)
        yield decode_pb2.DecodeResponse(token_ids=[7], text="ok", finish_reason="length",
                                        num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=1)


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, fail=None) -> None:
        self.fail = fail
        self.calls = 0

    async def GetLoad(self, request, context) -> common_pb2.Load:
        return common_pb2.Load()

    async def Prefill(self, request, context):
        self.calls += 1
        code, admitted = self.fail
        if admitted:
            await context.send_initial_metadata(ADMITTED_METADATA)
        await context.abort(code, "the test says so")


class _FirstListed:
    """Picks instances in the order the test started them: the failing one first."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def choose(self, instances, request):
        return min(instances, key=lambda i: self.order.index(i.target))


def _errors(role: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("tandem:router_instance_errors_total", {
        "role": "router", "model": MODEL, "target_role": role, "outcome": outcome}) or 0.0


async def _run(decodes: list[_Decode], prefills: list[_Prefill] = (), prompt_len: int = 4):
    """Dispatch one request; returns (deltas or the DispatchError, decode pool)."""
    servers, targets = [], {"prefill": [], "decode": []}
    for role, servicers, add in (
            ("decode", decodes, decode_pb2_grpc.add_DecodeServiceServicer_to_server),
            ("prefill", prefills, prefill_pb2_grpc.add_PrefillServiceServicer_to_server)):
        for servicer in servicers:
            server = await start_aio_grpc_server(lambda s, sv=servicer, a=add: a(sv, s) or [], "127.0.0.1", 0)
            servers.append(server)
            targets[role].append(f"127.0.0.1:{server.port}")
    decode = BackendPool("decode", targets["decode"], decode_pb2_grpc.DecodeServiceStub)
    prefill = BackendPool("prefill", targets["prefill"], prefill_pb2_grpc.PrefillServiceStub,
                          load_method="GetLoad")
    await decode.check_all()
    await prefill.check_all()
    order = targets["decode"] + targets["prefill"]
    dispatcher = Dispatcher(prefill, decode, _FirstListed(order), _FirstListed(order), prefill_threshold=2,
                            telemetry=RouterTelemetry(MODEL), decode_queue_wait_s=0.5)
    try:
        try:
            result = [d async for d in dispatcher.generate("r", list(range(1, prompt_len + 1)),
                                                            common_pb2.SamplingParams(max_tokens=4))]
        except DispatchError as exc:
            result = exc
        return result, decode
    finally:
        await decode.close()
        await prefill.close()
        for server in servers:
            await server.stop(0)


def test_an_instance_that_refuses_before_admission_is_skipped():
    before = _errors("decode", "retried")
    dead, alive = _Decode((grpc.StatusCode.UNAVAILABLE, False)), _Decode()
    result, pool = asyncio.run(_run([dead, alive]))
    assert [d.text for d in result] == ["ok"]
    assert dead.calls == 1 and alive.calls == 1
    assert _errors("decode", "retried") == before + 1
    assert [i.healthy for i in pool.instances] == [False, True]


def test_a_request_an_engine_failed_on_is_not_sent_on():
    before = _errors("decode", "failed")
    failing, alive = _Decode((grpc.StatusCode.UNAVAILABLE, True)), _Decode()
    result, _ = asyncio.run(_run([failing, alive]))
    assert isinstance(result, DispatchError) and result.http_status == 503
    assert failing.calls == 1 and alive.calls == 0
    assert _errors("decode", "failed") == before + 1


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.INTERNAL, 500),
                                         (grpc.StatusCode.UNKNOWN, 502)])
def test_other_engine_failures_after_admission_end_the_request_too(code, status):
    failing, alive = _Decode((code, True)), _Decode()
    result, _ = asyncio.run(_run([failing, alive]))
    assert isinstance(result, DispatchError) and result.http_status == status and alive.calls == 0


def test_a_bad_request_is_a_400_and_not_retried():
    before = _errors("decode", "failed") + _errors("decode", "retried")
    failing, alive = _Decode((grpc.StatusCode.INVALID_ARGUMENT, True)), _Decode()
    result, pool = asyncio.run(_run([failing, alive]))
    assert isinstance(result, DispatchError) and result.http_status == 400
    assert alive.calls == 0 and all(i.healthy for i in pool.instances)
    assert _errors("decode", "failed") + _errors("decode", "retried") == before


def test_a_full_instance_is_skipped_and_stays_in_the_pool():
    full, alive = _Decode((grpc.StatusCode.RESOURCE_EXHAUSTED, False)), _Decode()
    result, pool = asyncio.run(_run([full, alive]))
    assert [d.text for d in result] == ["ok"]
    assert all(i.healthy for i in pool.instances)


def test_a_prompt_a_prefill_engine_failed_on_does_not_fall_back_to_decode():
    """Decode prefilling it itself would hand the same prompt to another engine."""
    prefill, decode = _Prefill((grpc.StatusCode.UNAVAILABLE, True)), _Decode()
    result, _ = asyncio.run(_run([decode], [prefill]))
    assert isinstance(result, DispatchError) and result.http_status == 503
    assert prefill.calls == 1 and decode.calls == 0


def test_a_prefill_tier_that_refuses_means_decode_prefills():
    prefill, decode = _Prefill((grpc.StatusCode.UNAVAILABLE, False)), _Decode()
    result, _ = asyncio.run(_run([decode], [prefill]))
    assert [d.text for d in result] == ["ok"] and decode.calls == 1
