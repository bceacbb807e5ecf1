"""The gateway's surface in process (the real app, tokenizer and PromptPool
workers; no engines, so a request that passes every check ends in a clean
503 from routing): every field of openai's request TypedDicts and of the
field table honoured or refused by name, /tokenize and /detokenize,
/v1/models/{id}, --served-model-name and `tandem --version`.
tests/e2e/test_gateway_fields_e2e.py sends the same cases to real engines."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.engine.loader import load_model_info
from tandem.services.router.app import GatewayConfig
from tandem.services.router.frontend import ServedModel
from tandem.services.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.services.router.prompts import PromptPool
from tandem.services.router.request_fields import (ACCEPTED, CHAT, COMPLETIONS, DETOKENIZE, FIELDS,
                                                   HONOURED, TOKENIZE)
from tandem.services.router.tokenize_protocol import (DetokenizeRequest, TokenizeChatRequest,
                                                      TokenizeCompletionRequest)
from tests.support.request_fields import OPENAI_KEYS, base_request, cases
from tests.unit.test_router_gateway import make_client

pytestmark = pytest.mark.timeout(180)

ENGINE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODELS = {CHAT: [ChatCompletionRequest], COMPLETIONS: [CompletionRequest],
          TOKENIZE: [TokenizeCompletionRequest, TokenizeChatRequest], DETOKENIZE: [DetokenizeRequest]}
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
@pytest.fixture(scope="module")
def served() -> ServedModel:
    info = load_model_info("smollm2")
    return ServedModel(model_id=info.model_id, max_model_len=256, tokenizer=info.tokenizer,
                       aliases={"smollm2"}, served_names=["tandem-smol", "smol"])


@pytest.fixture(scope="module")
def client(served):
    pool = PromptPool(served.tokenizer, served.max_model_len, max_choices=8, workers=1)
    yield make_client(served, pool, GatewayConfig())
    pool.close()


# --- the table against the request models and openai's TypedDicts ----------------------

def test_every_openai_key_is_in_the_field_table():
    for endpoint, keys in OPENAI_KEYS.items():
        undecided = [k for k in keys if k not in FIELDS]
        assert not undecided, (f"openai's {endpoint} request has fields the gateway has not decided: "
                               f"{undecided}; add each to services/router/request_fields.py")


def test_the_table_and_the_request_models_agree():
    """A declared field is HONOURED or ACCEPTED on its endpoint; a refused one is declared nowhere
    (else its value would pass unchecked)."""
    for endpoint, models in MODELS.items():
        declared = {name for m in models for name in m.model_fields}
        for name in declared:
            rule = FIELDS.get(name)
            assert rule and rule.decision in (HONOURED, ACCEPTED) and endpoint in rule.on, (endpoint, name)
        for key, rule in FIELDS.items():
            if rule.decision in (HONOURED, ACCEPTED) and endpoint in rule.on and "." not in key \
                    and "[" not in key:
                assert key in declared, f"{key} is {rule.decision} on {endpoint} but not declared"


CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_field_is_honoured_or_refused_by_name(client, case):
    assert case.example is not None, (f"{case.id}: no example value; decide the field in "
                                      "request_fields.py and add one in tests/support/request_fields.py")
    r = client.post(PATHS[case.endpoint], json={**base_request(case.endpoint), **case.example.fields})
    error = r.json()["error"]
    if case.honoured:
        assert r.status_code == 503, error  # through every check, to routing (no engines here)
    else:
        param = case.example.param or case.key
        assert r.status_code == 400 and error["param"] == param and param in error["message"], error
        assert "not supported" in error["message"] or "unknown field" in error["message"]


DEFAULT_LIKE = [("store", False), ("service_tier", "auto"), ("service_tier", "default"),
                ("modalities", ["text"]), ("response_format", {"type": "text"}), ("tools", []),
                ("tool_choice", "none"), ("logit_bias", {}), ("metadata", {}), ("skip_special_tokens", True),
                ("priority", 0), ("use_beam_search", False), ("prompt_cache_retention", "in_memory"),
                ("tools", None), ("functions", None), ("anything_at_all", None)]


@pytest.mark.parametrize("name,value", DEFAULT_LIKE, ids=[f"{n}={v!r}" for n, v in DEFAULT_LIKE])
def test_values_that_ask_for_the_default_are_accepted(client, name, value):
    r = client.post(PATHS[CHAT], json={**base_request(CHAT), name: value})
    assert r.status_code == 503, r.text


def test_a_wrong_type_is_still_a_400_naming_the_field(client):
    r = client.post(PATHS[CHAT], json={**base_request(CHAT), "add_generation_prompt": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt"


def test_a_field_of_the_other_endpoint_is_refused(client):
    r = client.post(PATHS[COMPLETIONS], json={**base_request(COMPLETIONS), "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post(PATHS[COMPLETIONS], json={**base_request(COMPLETIONS), "add_generation_prompt": False})
    assert r.status_code == 400 and "not a field of this endpoint" in r.json()["error"]["message"]


def test_chat_template_kwargs_cannot_set_the_routers_own_arguments(client):
    r = client.post(PATHS[CHAT], json={**base_request(CHAT), "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_continue_final_message_needs_no_generation_prompt(client):
    r = client.post(PATHS[CHAT], json={**base_request(CHAT), "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


# --- /tokenize and /detokenize -----------------------------------------------------------

def test_tokenize_a_prompt_and_back(client, served):
    r = client.post("/tokenize", json={"model": "smol", "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == served.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello world"
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_a_chat_as_the_completion_would(client, served):
    messages = [{"role": "user", "content": "Hi"}]
    body = client.post("/tokenize", json={"messages": messages}).json()
    text = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == served.tokenizer.encode(text, add_special_tokens=False)
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < body["count"]


def test_tokenize_has_no_context_limit_and_takes_an_empty_prompt(client):
    # /tokenize is how a client learns a prompt is too long: it must answer, not refuse.
    assert client.post("/tokenize", json={"prompt": "word " * 400}).json()["count"] > 256
    assert client.post("/tokenize", json={"prompt": ""}).json()["count"] == 0


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "hi", "temperature": 1.0}, "temperature"),
    ("/tokenize", {"prompt": "hi", "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 10**8]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_tokenizer_endpoints_refuse_by_name(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_endpoints_check_the_model(client):
    r = client.post("/tokenize", json={"prompt": "hi", "model": "gpt-17"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- models and names ------------------------------------------------------------------

def test_served_model_names_are_listed_and_the_only_names_taken(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tandem-smol", "smol"]
    assert client.post(PATHS[CHAT], json={**base_request(CHAT), "model": "smol"}).status_code == 503
    r = client.post(PATHS[CHAT], json={**base_request(CHAT), "model": ENGINE_ID})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_retrieve_a_model(client):
    r = client.get("/v1/models/smol")
    assert r.status_code == 200 and r.json()["id"] == "smol" and r.json()["object"] == "model"
    r = client.get("/v1/models/no/such-model")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}
    assert client.get("/v1/models/").status_code == 404


def test_without_served_names_the_engines_id_with_its_slash_is_retrievable(served):
    pool = PromptPool(served.tokenizer, served.max_model_len, max_choices=8, workers=1)
    try:
        plain = ServedModel(model_id=served.model_id, max_model_len=256, tokenizer=served.tokenizer,
                            aliases={"smollm2"})
        c = make_client(plain, pool, GatewayConfig())
        assert c.get(f"/v1/models/{ENGINE_ID}").json()["id"] == ENGINE_ID
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [ENGINE_ID]
    finally:
        pool.close()


def test_router_and_up_take_served_model_name():
    import argparse

    from tandem.services.launcher.up import add_up_arguments
    from tandem.services.router.server import add_arguments, served_names_from_flag

    for add in (add_arguments, add_up_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        assert parser.parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
        assert parser.parse_args([]).served_model_name is None
    assert served_names_from_flag(["a", "b", "a"]) == ["a", "b"]
    with pytest.raises(SystemExit):
        served_names_from_flag([" "])


def test_tandem_version():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "tandem.services.cli", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"tandem {version('tandem')}"


def test_docs_api_md_is_the_field_table():
    """docs/api.md has one row per field, with its decision, and the values it says a refused
    field accepts are the ones the table allows."""
    import json
    import pathlib
    import re

    rows = {}
    for line in (pathlib.Path(__file__).parents[2] / "docs" / "api.md").read_text().splitlines():
        if m := re.match(r"\| `([^`]+)` \| (honoured|accepted|refused|not yet)\b[^|]*\|[^|]*\|(.*)\|$", line):
            rows[m.group(1)] = (m.group(2), re.findall(r"`([^`]+)`", m.group(3)))
    assert set(rows) == set(FIELDS), set(rows) ^ set(FIELDS)
    for key, (decision, values) in rows.items():
        assert decision == FIELDS[key].decision, key
        for value in values:
            assert FIELDS[key].allows(json.loads(value)), (key, value)
