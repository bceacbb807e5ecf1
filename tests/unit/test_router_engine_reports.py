"""The router validates against what its engines report (model id, context,
block size in every GetLoad), never a copy of its own: real backend pools
against fake engines on loopback whose reports the tests change."""
from __future__ import annotations

import asyncio
import types

import pytest

from tandem.services.common.aio_server import start_aio_grpc_server
from tandem.services.router.backends import BackendPool
from tandem.services.router.dispatch import DispatchError
from tandem.services.router.engine_reports import EngineReports, ModelView
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class _Engine(decode_pb2_grpc.DecodeServiceServicer, prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, model_id: str = MODEL, max_model_len: int = 2048, block_size: int = 16,
                 kv_key: str = "") -> None:
        self.load = common_pb2.Load(model_id=model_id, max_model_len=max_model_len, block_size=block_size,
                                    kv_key=kv_key)

    async def GetLoad(self, request, context) -> common_pb2.Load:
        return self.load


async def _serve(engine: _Engine, role: str):
    def add(server) -> list[str]:
        if role == "decode":
            decode_pb2_grpc.add_DecodeServiceServicer_to_server(engine, server)
        else:
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(engine, server)
        return [f"tandem.v1.{role.capitalize()}Service"]

    return await start_aio_grpc_server(add, "127.0.0.1", 0)


class _Tiers:
    """One prefill and two decode fake engines behind watched pools."""

    def __init__(self, prefill: _Engine, decodes: list[_Engine]) -> None:
        self.engines = [prefill, *decodes]

    async def __aenter__(self) -> "_Tiers":
        self.servers = [await _serve(self.engines[0], "prefill")]
        self.servers += [await _serve(e, "decode") for e in self.engines[1:]]
        self.reports = EngineReports(MODEL)
        self.prefill = self.reports.watch(BackendPool(
            "prefill", [f"127.0.0.1:{self.servers[0].port}"], prefill_pb2_grpc.PrefillServiceStub))
        self.decode = self.reports.watch(BackendPool(
            "decode", [f"127.0.0.1:{s.port}" for s in self.servers[1:]], decode_pb2_grpc.DecodeServiceStub))
        return self

    async def check(self) -> None:
        await self.prefill.check_all()
        await self.decode.check_all()

    async def __aexit__(self, *exc) -> None:
        await self.prefill.close()
        await self.decode.close()
        for server in self.servers:
            await server.stop(0)


def test_the_context_limit_is_the_smallest_any_healthy_instance_of_either_tier_reports():
    async def run() -> list:
        prefill, d1, d2 = _Engine(max_model_len=4096), _Engine(max_model_len=2048), _Engine(max_model_len=3000)
        async with _Tiers(prefill, [d1, d2]) as tiers:
            await tiers.check()
            views = [tiers.reports.view()]
            prefill.load.max_model_len = 1024  # an engine restarted with a smaller context
            await tiers.check()
            views.append(tiers.reports.view())
            await tiers.servers[0].stop(0)  # the prefill tier is gone: decode's limit is the limit
            await tiers.check()
            views.append(tiers.reports.view())
            return views

    assert asyncio.run(run()) == [ModelView(MODEL, 2048, 16), ModelView(MODEL, 1024, 16),
                                  ModelView(MODEL, 2048, 16)]


def test_an_instance_serving_another_model_is_kept_out_with_a_clear_error(caplog):
    async def run():
        prefill, d1, d2 = _Engine(), _Engine(), _Engine(model_id="Qwen/Qwen3-0.6B", max_model_len=512)
        async with _Tiers(prefill, [d1]) as tiers:
            await tiers.check()  # the pools agree on MODEL before the other one comes
            tiers.engines.append(d2)
            tiers.servers.append(await _serve(d2, "decode"))
            tiers.decode.targets.append(f"127.0.0.1:{tiers.servers[-1].port}")
            for _ in range(3):  # refused every round, logged once
                await tiers.check()
            return {i.target: (i.healthy, i.last_error) for i in tiers.decode.instances}, tiers.reports.view()

    with caplog.at_level("ERROR"):
        instances, view = asyncio.run(run())
    refused = [(healthy, error) for healthy, error in instances.values() if error]
    assert len(refused) == 1 and refused[0][0] is False
    assert "'Qwen/Qwen3-0.6B'" in refused[0][1] and repr(MODEL) in refused[0][1]
    assert view == ModelView(MODEL, 2048, 16)  # the stranger's 512 does not count
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


BF16_KEY, FP8_KEY = f"{MODEL}|torch.bfloat16", f"{MODEL}|torch.bfloat16|kv=torch.float8_e4m3fn"


@pytest.mark.parametrize("odd", [{"kv_key": FP8_KEY}, {"block_size": 32}], ids=["kv-cache-dtype", "block-size"])
def test_a_decode_whose_kv_blocks_the_prefill_cannot_share_is_kept_out(odd, caplog):
    """A prefill over a bf16 cache and a decode started with --kv-cache-dtype
    fp8 (or another --block-size) serve the same model, but the decode could
    never load the prefill's KV: refused by name, as another model is."""
    async def run():
        prefill, same = _Engine(kv_key=BF16_KEY), _Engine(kv_key=BF16_KEY)
        other = _Engine(**{"kv_key": BF16_KEY, **odd})
        async with _Tiers(prefill, [same, other]) as tiers:
            await tiers.check()
            return [(i.healthy, i.last_error) for i in tiers.decode.instances], tiers.reports.view()

    with caplog.at_level("ERROR"):
        instances, view = asyncio.run(run())
    assert instances[0][0] is True
    healthy, error = instances[1]
    assert healthy is False and "its KV blocks are" in error and "--kv-cache-dtype" in error, error
    if "kv_key" in odd:
        assert repr(FP8_KEY) in error and repr(BF16_KEY) in error
    else:
        assert "of 32 tokens" in error and "of 16 tokens" in error
    assert view == ModelView(MODEL, 2048, 16)


def test_engines_that_do_not_name_their_kv_blocks_are_not_held_to_it():
    """An engine before kv_key (empty) is vetted on its model id alone."""
    async def run():
        async with _Tiers(_Engine(kv_key=BF16_KEY), [_Engine(), _Engine(kv_key=BF16_KEY)]) as tiers:
            await tiers.check()
            return [i.healthy for i in tiers.decode.instances]

    assert asyncio.run(run()) == [True, True]


def test_engines_that_report_no_model_give_no_view():
    async def run():
        async with _Tiers(_Engine(model_id="", max_model_len=0), [_Engine(model_id="", max_model_len=0)]) as tiers:
            await tiers.check()
            return [i.healthy for i in tiers.decode.instances], tiers.reports.view()

    healthy, view = asyncio.run(run())
    assert healthy == [True] and view is None


def test_a_router_whose_engines_have_not_reported_answers_503_with_retry_after():
    from fastapi.testclient import TestClient

    from tandem.engine.loader import load_tokenizer
    from tandem.services.router.app import GatewayConfig, create_app
    from tandem.services.router.dispatch import Dispatcher
    from tandem.services.router.frontend import Frontend, ServedModel
    from tandem.services.router.policies import make_policy
    from tandem.services.router.telemetry import RouterTelemetry

    loaded = load_tokenizer("smollm2")
    served = ServedModel(model_id=loaded.model_id, tokenizer=loaded.tokenizer)  # no fallback limit
    prefill = BackendPool("prefill", [], prefill_pb2_grpc.PrefillServiceStub)
    decode = BackendPool("decode", [], decode_pb2_grpc.DecodeServiceStub)
    telemetry = RouterTelemetry(MODEL)
    dispatcher = Dispatcher(prefill, decode, make_policy("round_robin"), make_policy("round_robin"), 32,
                            telemetry)
    def unreachable(*args):
        raise AssertionError("a request was tokenized with no context limit to check it against")

    prompts = types.SimpleNamespace(chat_completion=unreachable, completion=unreachable)
    frontend = Frontend(served, dispatcher, prompts)
    with pytest.raises(DispatchError):
        frontend.view()
    client = TestClient(create_app(frontend, telemetry, {"prefill": prefill, "decode": decode},
                                   GatewayConfig()))
    for r in (client.get("/v1/models"),
              client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})):
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "reported" in r.json()["error"]["message"]


def test_the_tokenizer_workers_check_each_prompt_against_the_limit_of_its_job():
    from tandem.engine.loader import load_tokenizer
    from tandem.services.router.prompts import InvalidRequest, PromptPool

    tokenizer = load_tokenizer("smollm2").tokenizer
    prompts = PromptPool(tokenizer, workers=1)
    text = "word " * 60
    n = len(tokenizer.encode(text))
    body = f'{{"prompt": "{text}"}}'.encode()

    async def run(limit: int):
        try:
            return len((await prompts.completion(body, limit)).prompts[0])
        except InvalidRequest as exc:
            return exc.code, exc.message

    try:
        assert asyncio.run(run(1000)) == n
        code, message = asyncio.run(run(n))  # the same worker, a smaller limit now
        assert code == "context_length_exceeded" and f"{n} tokens" in message
        assert asyncio.run(run(n + 1)) == n
    finally:
        prompts.close()
