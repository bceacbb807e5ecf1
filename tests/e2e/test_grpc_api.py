"""The public gRPC API (tandem.v1.TandemService) of a real stack, through
stubs generated from the protos."""
from __future__ import annotations

import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.services.common.grpc_server import make_channel
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stub(tandem_stack):
    channel = make_channel(tandem_stack.grpc_target)
    yield generate_pb2_grpc.TandemServiceStub(channel)
    channel.close()


def generate(stub, **fields) -> list[generate_pb2.GenerateResponse]:
    return list(stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=120))


def test_generate_streams_a_chat(stub):
    params = common_pb2.SamplingParams(max_tokens=6, temperature=0.0)
    chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="Hello!")])
    replies = generate(stub, chat=chat, params=params)
    assert len(replies) >= 2  # streamed, not one blob
    tokens = [t for r in replies for t in r.token_ids]
    assert len(tokens) == 6 and "".join(r.text for r in replies).strip()
    last = replies[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 6
    assert all(not r.finish_reason for r in replies[:-1])


def test_generate_from_token_ids_and_prompt_agree(stub, tandem_stack):
    params = common_pb2.SamplingParams(max_tokens=5, temperature=0.0)
    from tandem.engine.loader import load_model_info

    ids = load_model_info("smollm2").tokenizer.encode("Once upon a time")
    by_ids = generate(stub, token_ids=generate_pb2.TokenIds(ids=ids), params=params)
    by_text = generate(stub, prompt="Once upon a time", params=params, model=tandem_stack.model)
    assert [t for r in by_ids for t in r.token_ids] == [t for r in by_text for t in r.token_ids]


def test_generate_n_choices(stub):
    params = common_pb2.SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=7)
    replies = generate(stub, prompt="A short poem:", params=params)
    finished = {r.index for r in replies if r.finish_reason}
    assert finished == {0, 1}


def test_generate_follows_a_constraint(stub):
    """SamplingParams.structured_outputs (a oneof): the same grammars as HTTP."""
    import grpc

    choices = common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=["red", "blue"]))
    replies = generate(stub, prompt="My favourite colour is", params=common_pb2.SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=choices))
    assert "".join(r.text for r in replies) in ("red", "blue")
    regex = common_pb2.StructuredOutputs(regex=r"[0-9]{3}", field_name="structured_outputs.regex")
    replies = generate(stub, prompt="A number:", params=common_pb2.SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=regex, logit_bias={28: -100.0}))
    assert len("".join(r.text for r in replies)) == 3
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, prompt="x", params=common_pb2.SamplingParams(
            max_tokens=3, structured_outputs=common_pb2.StructuredOutputs(regex="(")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("structured_outputs: the regex")


# Bad requests: tests/e2e/test_bad_inputs.py (the table over HTTP and gRPC).


def test_list_models(stub):
    models = stub.ListModels(generate_pb2.ListModelsRequest(), timeout=10).models
    assert [m.id for m in models] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert models[0].max_model_len > 0


def test_health_and_reflection(tandem_stack):
    channel = make_channel(tandem_stack.grpc_target)
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([request]), timeout=10))
        names = {s.name for s in reply.list_services_response.service}
        assert "tandem.v1.TandemService" in names
    finally:
        channel.close()


def test_cancelled_generate_aborts_the_request_in_decode(stub, tandem_stack):
    cancelled_before = tandem_stack.metric("router", "tandem:router_requests_total", status="CANCELLED")
    call = stub.Generate(generate_pb2.GenerateRequest(
        prompt="Count to a thousand:", params=common_pb2.SamplingParams(
            max_tokens=2000, ignore_eos=True, temperature=0.0)), timeout=120)
    for _, _reply in zip(range(3), call):
        pass
    call.cancel()  # the client leaves mid-stream
    assert tandem_stack.running_after("decode") == 0, "the cancelled request still runs in decode"
    # The router counts the request when its handler ends, which may be after
    # decode has dropped it; so wait for the count rather than read it once.
    deadline = time.monotonic() + 20
    while (cancelled := tandem_stack.metric("router", "tandem:router_requests_total", status="CANCELLED")) \
            < cancelled_before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cancelled == cancelled_before + 1
