"""Through prefill -> decode, a client reads exactly what `LLM.generate` writes
(SmolLM2, greedy): prefill answers with the first token's id only and the
decode engine detokenizes it with the rest. Before, the first token's text
came from prefill without the detokenizer's holdback: an emoji or CJK answer
began with U+FFFD and a stop string beginning in the first token leaked its
head. Prompts above and below the prefill threshold (32 tokens), chat and
completions, streaming and not, with the real `openai` client."""
from __future__ import annotations

import openai
import pytest

from tests.support.stack import TWO_BY_TWO, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TANDEM_STACK_OPTIONS = TWO_BY_TWO
THRESHOLD = 32
MAX_TOKENS = 10

# (name, chat message or completion prompt, stop strings)
CHAT_CASES = [
    ("emoji", "Reply with only one emoji for a happy face.", []),
    ("cjk", "Translate 'cat' to Chinese. Answer with only the Chinese characters.", []),
    ("stop string beginning in the first token", "Say exactly this and nothing else: hi there!",
     ["Hello there"]),
    ("stop string beginning in the second token", "Say exactly this and nothing else: hi there!",
     ["there!"]),
    ("below the threshold, stop string in the first token", "hi", ["Hello there"]),
    ("below the threshold", "hi", []),
]
COMPLETION_CASES = [
    ("emoji, below the threshold", "I love pizza 🍕🍕🍕", []),
    ("emoji, above the threshold", "My favourite food, in emojis only: 🍕🍕🍕 " * 4, []),
    ("cjk, above the threshold", "Chinese numbers: 一, 二, 三, 四, 五, 六, 七, 八, 九, 十, 一, 二, 三,", []),
]


@pytest.fixture(scope="module")
def llm():
    from tandem.engine import LLM

    return LLM("smollm2")


@pytest.fixture(scope="module")
def client(tandem_stack):
    return openai.OpenAI(base_url=tandem_stack.base_url, api_key="unused", max_retries=0, timeout=300)


def expected(llm, ids: list[int], stop: list[str]):
    from tandem.engine import SamplingParams

    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=stop))[0].outputs[0]


def test_the_cases_cover_both_sides_of_the_threshold(llm):
    lengths = [len(llm.chat_prompt([{"role": "user", "content": m}])) for _, m, _ in CHAT_CASES]
    lengths += [len(llm.encode(p)) for _, p, _ in COMPLETION_CASES]
    assert min(lengths) < THRESHOLD <= max(lengths)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name,message,stop", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_text_equals_the_colocated_engine(llm, client, tandem_stack, name, message, stop, stream):
    messages = [{"role": "user", "content": message}]
    want = expected(llm, llm.chat_prompt(messages), stop)
    kwargs = dict(model=tandem_stack.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  stop=stop or None)
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert "\ufffd" not in text[:1]
    assert (text, finish) == (want.text, want.finish_reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name,prompt,stop", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completion_text_equals_the_colocated_engine(llm, client, tandem_stack, name, prompt, stop, stream):
    want = expected(llm, llm.encode(prompt), stop)
    kwargs = dict(model=tandem_stack.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                  stop=stop or None)
    if stream:
        text, finish = "", None
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert (text, finish) == (want.text, want.finish_reason)


def test_usage_counts_the_first_token_once(client, tandem_stack):
    r = client.chat.completions.create(model=tandem_stack.model, max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": CHAT_CASES[0][1]}],
                                       logprobs=True, top_logprobs=2)
    assert r.usage.completion_tokens == 5
    assert len(r.choices[0].logprobs.content) == 5  # the first token's logprob came from prefill
