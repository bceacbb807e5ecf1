"""The gateway's validation, errors and auth, in process: the real FastAPI app,
the real tokenizer and chat template, and a decode tier with no healthy
instance (so a valid request gets as far as routing and a clean 503)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tandem.engine.loader import load_model_info
from tandem.services.router.app import GatewayConfig, create_app
from tandem.services.router.backends import BackendPool
from tandem.services.router.dispatch import Dispatcher
from tandem.services.router.frontend import Frontend, ServedModel
from tandem.services.router.policies import make_policy
from tandem.services.router.prompts import PromptPool
from tandem.services.router.telemetry import RouterTelemetry
from tandem.v1 import decode_pb2_grpc, prefill_pb2_grpc

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served() -> ServedModel:
    info = load_model_info("smollm2")
    return ServedModel(model_id=info.model_id, max_model_len=256, tokenizer=info.tokenizer,
                       aliases={"smollm2"})


@pytest.fixture(scope="module")
def prompts(served) -> PromptPool:
    pool = PromptPool(served.tokenizer, served.max_model_len, max_choices=8, workers=1)
    yield pool
    pool.close()


def make_client(served: ServedModel, prompts: PromptPool, config: GatewayConfig,
                raise_server_exceptions: bool = False) -> TestClient:
    # No targets in either tier: nothing is ever healthy, no channel is used.
    prefill = BackendPool("prefill", [], prefill_pb2_grpc.PrefillServiceStub)
    decode = BackendPool("decode", [], decode_pb2_grpc.DecodeServiceStub)
    telemetry = RouterTelemetry(served.model_id)
    dispatcher = Dispatcher(prefill, decode, make_policy("round_robin"), make_policy("round_robin"),
                            32, telemetry)
    app = create_app(Frontend(served, dispatcher, prompts), telemetry,
                     {"prefill": prefill, "decode": decode}, config)
    return TestClient(app, raise_server_exceptions=raise_server_exceptions)


@pytest.fixture(scope="module")
def client(served, prompts) -> TestClient:
    return make_client(served, prompts, GatewayConfig(max_body_bytes=64 * 1024))


def chat(**overrides) -> dict:
    body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]}
    body.update(overrides)
    return body


BAD_CHATS = [
    ("wrong type", chat(max_tokens="ten"), 400, "max_tokens"),
    ("empty messages", chat(messages=[]), 400, "messages"),
    ("unknown role", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("over the context", chat(max_tokens=10_000), 400, "max_tokens"),
    ("n zero", chat(n=0), 400, "n"),
    ("n too large", chat(n=1000), 400, "n"),
    ("negative temperature", chat(temperature=-1.0), 400, "temperature"),
    ("top_p zero", chat(top_p=0.0), 400, "top_p"),
    ("top_logprobs alone", chat(top_logprobs=3), 400, "top_logprobs"),
    ("too many top_logprobs", chat(logprobs=True, top_logprobs=50), 400, "logprobs"),
    ("stop of wrong type", chat(stop=[1, 2]), 400, "stop"),
    ("unknown model", chat(model="gpt-17"), 404, "model"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_requests_get_openai_errors(client, name, body, status, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert param in (error["param"] or "") or param in error["message"]


def completion(**overrides) -> dict:
    body = {"prompt": "Hello", "max_tokens": 4}
    body.update(overrides)
    return body


# Beam search (services/router/beam.py): refusals name the field.
BAD_BEAM_REQUESTS = [
    ("best_of without beam search", completion(best_of=3), "best_of"),
    ("best_of below n", completion(use_beam_search=True, n=3, best_of=2), "best_of"),
    ("beam width over 10", completion(use_beam_search=True, best_of=11), "best_of"),
    ("n as width over 10", completion(use_beam_search=True, n=12), "n"),
    ("early_stopping unknown", completion(use_beam_search=True, early_stopping="always"), "early_stopping"),
    ("length_penalty not a number", completion(use_beam_search=True, length_penalty="1"), "length_penalty"),
    ("sampling with beams", completion(use_beam_search=True, temperature=0.7), "temperature"),
    ("logprobs with beams", completion(use_beam_search=True, logprobs=2), "logprobs"),
    ("stop with beams", completion(use_beam_search=True, stop=["."]), "stop"),
    ("chat logprobs with beams", dict(chat(use_beam_search=True, logprobs=True)), "logprobs"),
]


@pytest.mark.parametrize("name,body,param", BAD_BEAM_REQUESTS, ids=[c[0] for c in BAD_BEAM_REQUESTS])
def test_bad_beam_search_requests_name_the_field(client, name, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_neutral_sampling_values_pass_with_beam_search(client):
    # temperature 0 and top_p 1 ask for nothing beam search does not do: the
    # request gets as far as routing (no decode instance here: 503).
    r = client.post("/v1/completions", json=completion(use_beam_search=True, n=2, temperature=0,
                                                       top_p=1.0, best_of=2))
    assert r.status_code == 503, r.text


def test_malformed_json_is_a_400(client):
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_invalid_utf8_is_a_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]


def test_oversize_body_is_a_413(client):
    r = client.post("/v1/completions", json={"prompt": "x" * 100_000})
    assert r.status_code == 413


def test_completion_token_ids_outside_the_vocabulary(client):
    r = client.post("/v1/completions", json={"prompt": [1, 2, 10**8], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_valid_request_without_decode_instances_is_a_clean_503(client):
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503
    assert "decode" in r.json()["error"]["message"]


def test_models_lists_the_stable_id(client, served):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [served.model_id]


def test_unknown_route_is_an_openai_error(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_health_says_unavailable_without_decode(client):
    assert client.get("/health").status_code == 503


def test_metrics_are_exposed(client):
    client.post("/v1/chat/completions", json=chat(n=0))
    text = client.get("/metrics").text
    assert 'tandem:router_requests_total{' in text and 'status="400"' in text


def test_api_key_is_required_except_for_health(served, prompts):
    keyed = make_client(served, prompts,
                        GatewayConfig(api_keys=[KEY, "another-key"], max_body_bytes=64 * 1024))
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer another-key"}).status_code == 200
    assert keyed.get("/health").status_code == 503  # reachable without a key (no decode here)


def test_router_at_its_limit_answers_429_with_retry_after(served, prompts):
    r = make_client(served, prompts, GatewayConfig(max_in_flight=0)).post("/v1/chat/completions", json=chat())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_a_refused_stream_gets_its_real_status_not_200(client):
    # The status line waits for the first token, so a request no decode can take
    # is a 503 with Retry-After, not a 200 followed by an error event.
    r = client.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "decode" in r.json()["error"]["message"]


def test_status_series_exist_from_startup(client):
    text = client.get("/metrics").text
    for status in ("429", "499", "503", "RESOURCE_EXHAUSTED"):
        assert f'status="{status}"' in text
    assert "tandem:router_healthy_instances{" in text


def test_grpc_api_needs_a_key_too_and_keys_come_from_the_environment(served, prompts, monkeypatch):
    import argparse
    import asyncio

    import grpc

    from tandem.services.common.aio_server import start_aio_grpc_server
    from tandem.services.router.grpc_api import TandemServicer, add_tandem_service
    from tandem.services.router.server import add_arguments
    from tandem.v1 import generate_pb2, generate_pb2_grpc

    monkeypatch.setenv("TANDEM_API_KEY", f"{KEY},another-key")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    keys = parser.parse_args([]).api_key
    assert keys == [KEY, "another-key"]

    async def codes() -> list[str]:
        decode = BackendPool("decode", [], decode_pb2_grpc.DecodeServiceStub)
        telemetry = RouterTelemetry(served.model_id)
        dispatcher = Dispatcher(decode, decode, make_policy("round_robin"), make_policy("round_robin"),
                                32, telemetry)
        servicer = TandemServicer(Frontend(served, dispatcher, prompts), telemetry, keys)
        server = await start_aio_grpc_server(lambda s: add_tandem_service(s, servicer), "127.0.0.1", 0)
        out = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generate_pb2_grpc.TandemServiceStub(channel)
            for token in (None, "wrong", KEY, "another-key"):
                metadata = (("authorization", f"Bearer {token}"),) if token else None
                try:
                    await stub.ListModels(generate_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
                    out.append("OK")
                except grpc.aio.AioRpcError as exc:
                    out.append(exc.code().name)
        await server.stop(0)
        return out

    assert asyncio.run(codes()) == ["UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "OK"]


def test_more_completions_than_the_cap_is_a_400_naming_the_field(client):
    # max_choices is 8 here: 9 prompts, or one prompt with n=9, ask for too much.
    r = client.post("/v1/completions", json={"prompt": ["hi"] * 9, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "--max-choices-per-request" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=chat(n=9))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_a_router_failure_is_answered_as_json_and_logged_once(served, prompts, monkeypatch, caplog):
    def broken(self, name):
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(Frontend, "check_model", broken)
    # raise_server_exceptions: an exception that escaped the app would be raised
    # here, as uvicorn would log it (a second time).
    strict = make_client(served, prompts, GatewayConfig(), raise_server_exceptions=True)
    with caplog.at_level("ERROR"):
        r = strict.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "a bug" not in r.text  # never the exception to the client
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None


def test_a_full_tokenizer_pool_answers_429_with_retry_after(served, prompts, monkeypatch):
    import threading
    import time

    client = make_client(served, prompts, GatewayConfig())
    monkeypatch.setattr(prompts, "queue", 0)  # one job in its one worker, none waiting
    # About a second of tokenizing in the worker (then refused: over the context).
    big = threading.Thread(target=client.post, args=("/v1/completions",),
                           kwargs={"json": {"prompt": "word " * 400_000, "max_tokens": 2}})
    big.start()
    deadline = time.monotonic() + 10
    while prompts.outstanding == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    r = client.post("/v1/chat/completions", json=chat())
    big.join()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "--tokenizer-queue" in r.json()["error"]["message"]


def test_invalid_request_keeps_its_field_across_processes():
    import pickle

    from tandem.services.router.prompts import InvalidRequest

    exc = pickle.loads(pickle.dumps(InvalidRequest("n: too many", param="n", status=404, code="x")))
    assert (exc.message, exc.param, exc.status, exc.code) == ("n: too many", "n", 404, "x")
