"""Structured outputs in the engine (real SmolLM2, xgrammar): every answer
follows its JSON schema, regex, choice or EBNF grammar; a decode that takes
the prefill's first token rebuilds the grammar state and continues exactly
as a colocated engine; a constraint that does not compile fails its request
alone; logit_bias moves the logits."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tandem.engine import SamplingParams
from tandem.engine.grammar import TokenMasks, allocate_bitmask, allowed_tokens, apply_bitmask_torch
from tandem.engine.llm import LLM
from tandem.engine.structured_outputs import StructuredOutputs, StructuredOutputsError
from tandem.services.common.proto_convert import sampling_params_from_proto, sampling_params_to_proto
from tests.support.json_schemas import SCHEMAS, prompt_for

ARITHMETIC = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
'''


def _parses_as_arithmetic(text: str) -> bool:
    # The grammar's language, checked by Python's own parser: digits,
    # operators and balanced parentheses that make one expression.
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        return False
    try:
        compile(text, "<answer>", "eval")
    except SyntaxError:
        return False
    return True


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", num_blocks=400)


def _greedy(llm, so: StructuredOutputs, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)


def test_json_schema_answers_validate(llm):
    # One of each shape, from five domains (the e2e test runs all fifty).
    schemas = [SCHEMAS[i * 11] for i in range(5)]
    prompts = [llm.chat_prompt([{"role": "user", "content": prompt_for(s)}]) for s in schemas]
    outs = llm.generate(prompts, [_greedy(llm, StructuredOutputs(json=s)) for s in schemas])
    for schema, out in zip(schemas, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema["title"], completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_regex_choice_and_grammar(llm):
    ask = lambda text: llm.chat_prompt([{"role": "user", "content": text}])  # noqa: E731
    regex = r"[A-Z][a-z]{2,8} [0-9]{2,4}"
    cases = [
        (ask("Name a city and a year."), StructuredOutputs(regex=regex)),
        (ask("Is the sky blue?"), StructuredOutputs(choice=["yes", "no", "it depends"])),
        (ask("Write an arithmetic expression."), StructuredOutputs(grammar=ARITHMETIC)),
        (ask("Describe a cat in JSON."), StructuredOutputs(json_object=True)),
    ]
    outs = llm.generate([p for p, _ in cases], [_greedy(llm, so, 300) for _, so in cases])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in ("yes", "no", "it depends")
    # The grammar alone may run to max_tokens (a number of numbers); an
    # answer that stopped is a whole expression.
    if outs[2].outputs[0].finish_reason == "stop":
        assert _parses_as_arithmetic(texts[2]), texts[2]
    assert all(c in "0123456789+-*/()" for c in texts[2]), texts[2]
    if outs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[3]), dict)
    assert texts[3].startswith("{")


def test_sampled_constrained_answers_follow_the_grammar(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Pick a colour."}])
    so = StructuredOutputs(choice=["red", "green", "blue", "light yellow"])
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=7, n=6, max_tokens=10, structured_outputs=so)
    out = llm.generate([prompt], params)[0]
    assert all(c.text in so.choice for c in out.outputs), [c.text for c in out.outputs]


def test_decode_rebuilds_the_grammar_over_the_prefill_token(llm):
    """Prefill samples the first token under the grammar; a decode engine
    gets it as first_token_ids, advances its matcher over it, and the answer
    equals a colocated run's token for token."""
    schema = SCHEMAS[2]
    prompt = llm.chat_prompt([{"role": "user", "content": prompt_for(schema)}])
    so = StructuredOutputs(json=schema)
    whole = llm.generate([prompt], _greedy(llm, so))[0].outputs[0]
    first = llm.generate([prompt], _greedy(llm, so, max_tokens=1))[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("decode-side", prompt, _greedy(llm, so), first_token_ids=first)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
    assert tokens == whole.token_ids


def test_a_first_token_outside_the_grammar_fails_the_request(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Say yes or no."}])
    so = StructuredOutputs(choice=["yes", "no"], field_name="guided_choice")
    not_allowed = llm.tokenizer.encode("maybe", add_special_tokens=False)[:1]
    engine = llm.engine
    engine.add_request("bad-first", prompt, _greedy(llm, so), first_token_ids=not_allowed)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    failed = [o for o in outs if o.finished]
    assert failed and failed[-1].finish_reason == "error"
    assert "guided_choice" in str(failed[-1].error) and "does not follow the grammar" in str(failed[-1].error)


def test_a_grammar_that_does_not_compile_fails_only_its_request(llm):
    engine = llm.engine
    prompt = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    engine.add_request("bad-regex", prompt, _greedy(llm, StructuredOutputs(regex="(unclosed", field_name="guided_regex")))
    engine.add_request("good", prompt, SamplingParams(temperature=0.0, max_tokens=4))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad-regex"].finish_reason == "error"
    assert str(finished["bad-regex"].error).startswith("guided_regex: the regex")
    assert finished["bad-regex"].error.caused_by_request
    assert finished["good"].finish_reason == "length"


def test_abort_while_the_grammar_compiles(llm):
    engine = llm.engine
    prompt = llm.chat_prompt([{"role": "user", "content": "Hi"}])
    engine.add_request("aborted", prompt, _greedy(llm, StructuredOutputs(json=SCHEMAS[7])))
    engine.abort("aborted")
    assert not engine.has_unfinished()
    assert all(o.request_id != "aborted" for o in engine.step())


def test_logit_bias_moves_the_choice(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Count to three."}])
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids
    banned = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3,
                                                   logit_bias={plain[0]: -100.0}))[0].outputs[0].token_ids
    assert banned[0] != plain[0]
    forced = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3,
                                                   logit_bias={1000: 100.0}))[0].outputs[0].token_ids
    assert forced == [1000, 1000, 1000]


def test_bad_constraints_and_biases_are_refused_by_name():
    with pytest.raises(StructuredOutputsError, match="^guided_json: the JSON schema is not valid JSON"):
        StructuredOutputs(json="{not json", field_name="guided_json")
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(StructuredOutputsError, match="choice must be"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="^ignore_eos:"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a+"))


def test_constraints_and_biases_cross_the_wire():
    for so in (StructuredOutputs(json=SCHEMAS[4], field_name="response_format"), StructuredOutputs(json_object=True),
               StructuredOutputs(regex="[a-z]+"), StructuredOutputs(choice=["a", "b c"]),
               StructuredOutputs(grammar=ARITHMETIC)):
        params = SamplingParams(max_tokens=5, logit_bias={3: -2.5}, structured_outputs=so)
        back = sampling_params_from_proto(sampling_params_to_proto(params))
        assert back.structured_outputs == so and back.structured_outputs.field_name == so.field_name
        assert back.logit_bias == {3: -2.5}


def test_bitmask_applies_on_any_rows():
    vocab = 70
    bitmask = allocate_bitmask(3, vocab)
    bitmask[2] = 0
    bitmask[2, 1] = 1 << 3  # token 35 only
    bitmask[0, 2] = 0  # tokens 64..69 forbidden
    bitmask[1] = 0  # row 1 is not constrained: its bits must not matter
    before = torch.randn(3, vocab + 6)  # padded vocabulary: the masks see a view
    expected = before.clone()
    apply_bitmask_torch(expected[:, :vocab], bitmask, [2, 0])
    assert torch.equal(expected[1], before[1])
    assert torch.isfinite(expected[2, :vocab]).nonzero().flatten().tolist() == [35]
    assert torch.isinf(expected[0, 64:vocab]).all() and torch.equal(expected[0, :64], before[0, :64])
    assert torch.equal(expected[:, vocab:], before[:, vocab:])
    assert allowed_tokens(bitmask, vocab).sum(dim=1).tolist() == [64, 0, 1]
    for dtype in (torch.float32, torch.bfloat16):
        logits = before.to(dtype)
        TokenMasks(bitmask, [2, 0]).apply(logits[:, :vocab])  # xgrammar's kernel, or the twin
        assert torch.equal(logits, expected.to(dtype))
