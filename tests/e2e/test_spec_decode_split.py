"""Speculative decoding through prefill -> decode, in real processes (`tandem
up` with --speculative-config): the prefill engine computes each prompt and
its first token (and does not speculate: it samples one token); the decode
engine takes the prompt's KV and that token and speculates with prompt
lookup from its first step on. A client reads exactly what a colocated
engine without speculation writes, streamed or not, and the decode's
Prometheus counters show drafts proposed and accepted."""
from __future__ import annotations

import json
import time

import openai
import pytest

from tests.support.stack import StackOptions, owned_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "adaptive": False}  # drafts wherever found: the counters below must move
MAX_TOKENS = 40
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed "
        "how knowledge moved across Europe. Before it, books were copied by hand, slowly and at great cost.")
PROMPTS = [  # --prefill-threshold 1: every one goes through the prefill engine
    f"Repeat this text exactly.\nText: {TEXT}\nRepeated text: The history",
    f"Here is a sentence: {TEXT}\nNow the same sentence in capital letters:",
    "Count from one to twenty in words, separated by commas, starting like this: one, two, three, four, five,",
]


@pytest.fixture(scope="module")
def stack():
    yield from owned_stack(StackOptions(prefill=1, decode=1, private=True, extra_args=(
        "--num-blocks", "300", "--prefill-threshold", "1", "--speculative-config", json.dumps(SPEC))))


@pytest.fixture(scope="module")
def expected():
    from tandem.engine import LLM, SamplingParams

    llm = LLM()  # no speculation
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def counter(stack, role: str, name: str) -> float:
    return sum(stack.metric(c["name"], f"tandem:spec_decode_{name}_total")
               for c in stack.children if c["role"] == role)


def test_the_decode_engine_speculates_after_the_handoff_and_answers_the_same(stack, expected):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
    for i, (prompt, want) in enumerate(zip(PROMPTS, expected)):
        kwargs = dict(model=stack.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        if i % 2:
            text, finish = "", None
            for chunk in client.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    text += choice.text
                    finish = choice.finish_reason or finish
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == want, f"prompt {i}"
    time.sleep(1.5)  # engine metrics are polled every 0.5 s
    accepted, proposed = counter(stack, "decode", "num_accepted_tokens"), counter(stack, "decode", "num_draft_tokens")
    assert proposed > accepted > 10, (proposed, accepted)
    assert counter(stack, "decode", "num_emitted_tokens") > counter(stack, "decode", "num_drafts")
    assert counter(stack, "prefill", "num_draft_tokens") == 0
    assert stack.metric("router", "tandem:router_prefill_skipped_total") == 0, "every prompt went through prefill"
