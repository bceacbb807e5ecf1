"""The router checks requests against what its engines report, on a real
stack whose engines run with `--max-model-len 512` (`tandem up` passes it to
the engines only): each engine's GetLoad says model, context, block size and
its KV blocks' name;
/v1/models and ListModels say 512; a request over 512 tokens is a 400 naming
512; an unset max_tokens is what 512 leaves after the prompt."""
from __future__ import annotations

import httpx
import pytest

from tandem.services.common.grpc_server import make_channel
from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from tests.support.stack import StackOptions, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# The same options as test_metrics_live.py: one stack for both in a session (this
# file sorts right after it, so that stack stops before the next one starts).
TANDEM_STACK_OPTIONS = StackOptions(extra_args=("--num-blocks", "64", "--max-model-len", "512"))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONTEXT = 512


def test_each_engine_reports_its_model_context_and_block_size(tandem_stack):
    """And the name of its KV blocks (model and dtypes), the same for every
    engine of one stack: the router keeps out one whose KV the others cannot
    share (tests/unit/test_router_engine_reports.py)."""
    stubs = {"prefill": prefill_pb2_grpc.PrefillServiceStub, "decode": decode_pb2_grpc.DecodeServiceStub}
    kv_keys = set()
    for child in tandem_stack.children:
        if child["role"] not in stubs:
            continue
        channel = make_channel(child["address"])
        try:
            load = stubs[child["role"]](channel).GetLoad(common_pb2.LoadRequest(), timeout=10)
        finally:
            channel.close()
        assert (load.model_id, load.max_model_len, load.block_size) == (MODEL, CONTEXT, 16), child["name"]
        assert load.kv_key.startswith(f"{MODEL}|torch."), load.kv_key
        kv_keys.add(load.kv_key)
    assert len(kv_keys) == 1, kv_keys


def test_models_and_list_models_give_the_engines_context(tandem_stack):
    data = httpx.get(f"{tandem_stack.base_url}/models", timeout=10).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in data] == [(MODEL, CONTEXT)]
    channel = make_channel(tandem_stack.grpc_target)
    try:
        models = generate_pb2_grpc.TandemServiceStub(channel).ListModels(
            generate_pb2.ListModelsRequest(), timeout=10).models
    finally:
        channel.close()
    assert [(m.id, m.max_model_len) for m in models] == [(MODEL, CONTEXT)]


def test_a_request_over_the_engines_context_is_a_400_naming_it(tandem_stack):
    r = httpx.post(f"{tandem_stack.base_url}/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 600})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"{CONTEXT} tokens" in error["message"]
    r = httpx.post(f"{tandem_stack.base_url}/completions", timeout=60,
                   json={"model": MODEL, "prompt": list(range(100, 100 + CONTEXT)), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"{CONTEXT} tokens" in r.json()["error"]["message"]


def test_an_unset_max_tokens_is_what_the_engines_context_leaves(tandem_stack):
    prompt = list(range(100, 100 + CONTEXT - 6))
    r = httpx.post(f"{tandem_stack.base_url}/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"
