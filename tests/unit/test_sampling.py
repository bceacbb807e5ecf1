"""Sampling parameters and stop rules on the embedded model."""
import pytest

from tandem.engine import LLM, SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2")


PROMPT = "Once upon a time, in a small village,"


def test_seed_makes_sampling_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12)
    a = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    b = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    c = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.9, seed=124, max_tokens=12))[0].outputs[0].token_ids
    assert a == b and a != c


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].token_ids
    topk1 = llm.generate([PROMPT], SamplingParams(temperature=0.8, top_k=1, seed=5, max_tokens=10))[0].outputs[0].token_ids
    assert greedy == topk1


def test_parallel_sampling_n_shares_the_prompt_blocks(llm):
    out = llm.generate([PROMPT * 4], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8))[0]
    assert len(out.outputs) == 4
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.num_cached_tokens > 0, "children reuse the prompt's blocks"
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


def test_stop_string_cuts_the_text(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    word = base.split()[2]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, stop=[word]))[0].outputs[0]
    assert word not in out.text and out.finish_reason == "stop" and out.stop_reason == word
    assert base.startswith(out.text)


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    stop_at = base.token_ids[3]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids[-1] == stop_at and out.finish_reason == "stop"


def test_repetition_penalty_changes_greedy_output(llm):
    prompt = "one two one two one two one two"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    penalized = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, repetition_penalty=2.0))[0].outputs[0].token_ids
    assert plain != penalized


def test_logprobs_of_chosen_and_top_tokens(llm):
    c = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.logprob == pytest.approx(max(lp.top.values()))  # greedy picks the top token


def test_abort_returns_blocks(llm):
    engine = llm.engine
    free0 = engine.kv.pool.num_free_blocks
    engine.add_request("a", llm.encode(PROMPT * 10), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free_blocks < free0
    engine.abort("a")
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_free_blocks == free0


@pytest.mark.parametrize("kwargs,field", [
    ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_prompt_over_the_context_is_refused(llm):
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        llm.engine.add_request("big", [1] * 100, SamplingParams(max_tokens=llm.engine.max_model_len))
