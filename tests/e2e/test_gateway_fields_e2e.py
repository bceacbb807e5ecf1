"""The gateway's surface against real engines (`tandem up --served-model-name
tandem-smol smol`, one decode instance that prefills itself), through the
real `openai` client: every field of openai's chat and completions requests
and of the field table gets an answer (honoured) or a 400 naming it
(refused), never a silent drop; /tokenize and /detokenize; the served names.
The same cases run in process, without engines, in
tests/unit/test_gateway_surface.py."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.request_fields import CHAT, cases, request_for
from tests.support.stack import StackOptions, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TANDEM_STACK_OPTIONS = StackOptions(prefill=0, decode=1, extra_args=(
    "--served-model-name", "tandem-smol", "smol", "--num-blocks", "600"))
ENGINE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CASES = cases()


@pytest.fixture(scope="module")
def client(tandem_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=tandem_stack.base_url, api_key="unused", max_retries=0, timeout=120)


def send(client: openai.OpenAI, case) -> dict:
    """The answer as a dict (a stream: its chunks, checked to end well)."""
    sent = request_for(case)
    create = client.chat.completions.create if case.endpoint == CHAT else client.completions.create
    answer = create(**sent.kwargs, extra_body=sent.extra_body or None)
    if not sent.kwargs.get("stream"):
        return answer.model_dump()
    chunks = [chunk.model_dump() for chunk in answer]
    assert chunks and any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), chunks
    return {"chunks": chunks}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_field_is_honoured_or_refused_by_name(client, case):
    assert case.example is not None, f"{case.id}: a field nobody decided (see tests/support/request_fields.py)"
    if case.honoured:
        answer = send(client, case)
        assert case.example.check is None or case.example.check(answer), answer
        if "chunks" not in answer:
            assert answer["model"] == "tandem-smol"  # the first served name
        return
    with pytest.raises(openai.BadRequestError) as refused:
        send(client, case)
    error = refused.value.response.json()["error"]
    param = case.example.param or case.key
    assert error["param"] == param and param in error["message"], error


def test_served_names(tandem_stack, client):
    assert [m.id for m in client.models.list().data] == ["tandem-smol", "smol"]
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(ENGINE_ID)  # the engines' own id is not one of the served names
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=ENGINE_ID, prompt="Hi", max_tokens=1)


def test_tokenize_detokenize_and_the_count_a_completion_reports(tandem_stack, client):
    url = tandem_stack.http_url
    prompt = "The capital of France is"
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "smol", "prompt": prompt}, timeout=30).json()
    assert tokenized["max_model_len"] > 0 and tokenized["count"] == len(tokenized["tokens"])
    detok = httpx.post(f"{url}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30).json()
    assert detok == {"prompt": prompt}
    completion = client.completions.create(model="smol", prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == tokenized["count"]

    messages = [{"role": "user", "content": "Hello there"}]
    chat_count = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()["count"]
    chat = client.chat.completions.create(model="tandem-smol", messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == chat_count
