"""One request's parameters can fail that request, never the engine: the one
validation every entry runs refuses what the sampler cannot compute with, a
request that breaks sampling anyway is failed alone while its batch goes on,
and an engine whose loop dies says so to every caller."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from tandem.engine import (LLM, AsyncLLMEngine, EngineDeadError, RequestFailedError, SamplingParams,
                           SamplingParamsError)
from tandem.engine.request import INT64_MAX, INT64_MIN, Request, choice_seed
from tandem.engine.sampler import Sampler

SUBNORMAL = 1e-45  # the smallest float32 subnormal: what a JSON 1e-45 becomes on the wire

# (fields, the field the error must name)
HOSTILE = [
    ({"repetition_penalty": SUBNORMAL}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e30}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -math.inf}, "temperature"),
    ({"temperature": 1e-40}, "temperature"),
    ({"temperature": 1e6}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": SUBNORMAL}, "top_p"),
    ({"min_p": 1e-39}, "min_p"),
    ({"presence_penalty": math.inf}, "presence_penalty"),
    ({"frequency_penalty": -SUBNORMAL}, "frequency_penalty"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": INT64_MAX + 1}, "seed"),
    ({"seed": INT64_MIN - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"n": True}, "n"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize("fields,name", HOSTILE, ids=[str(f) for f, _ in HOSTILE])
def test_validation_refuses_what_the_sampler_cannot_compute_with(fields, name):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**fields)
    assert info.value.field == name, str(info.value)


@pytest.mark.parametrize("fields", [
    {"temperature": 1e-6}, {"temperature": 100.0}, {"top_p": 1e-30}, {"min_p": 1.0},
    {"repetition_penalty": 0.01}, {"repetition_penalty": 100.0}, {"seed": INT64_MAX},
    {"seed": INT64_MIN}, {"top_k": 2**31 - 1}, {"min_tokens": 5, "max_tokens": 5},
])
def test_validation_keeps_values_at_the_edges(fields):
    SamplingParams(**fields)


def test_choice_seeds_wrap_within_int64():
    assert choice_seed(INT64_MAX, 1) == INT64_MIN
    assert choice_seed(INT64_MIN, 0) == INT64_MIN
    assert choice_seed(7, 3) == 10
    assert choice_seed(None, 3) is None


def test_a_row_without_a_finite_probability_fails_alone():
    vocab = 8
    sampler = Sampler(vocab)
    params = SamplingParams(temperature=1.0, seed=1)
    requests = [Request(f"r{i}", [1, 2], params) for i in range(3)]
    logits = torch.randn(3, vocab)
    logits[1, 3] = math.nan
    result = sampler(logits, requests)
    assert set(result.errors) == {1}
    assert 0 <= result.token_ids[0] < vocab and 0 <= result.token_ids[2] < vocab


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2")


PROMPT = "The capital of France is"


def _drain(engine) -> dict:
    outputs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_a_request_that_breaks_sampling_fails_alone_and_the_batch_goes_on(llm):
    engine = llm.engine
    ids = llm.encode(PROMPT)
    alone = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    engine.add_request("poison", ids, SamplingParams(temperature=1.0, max_tokens=6))
    engine.add_request("ordinary", ids, SamplingParams(temperature=0, max_tokens=6))
    # A value past validation (a caller changed it after add_request): the
    # engine reads parameters live, so this is what slipping through looks like.
    engine.scheduler.requests["poison"].params.repetition_penalty = SUBNORMAL
    outputs = _drain(engine)
    poison = outputs["poison"][-1]
    assert poison.finished and poison.finish_reason == "error"
    assert isinstance(poison.error, RequestFailedError) and "repetition_penalty" in str(poison.error)
    assert [t for o in outputs["ordinary"] for t in o.new_token_ids] == alone
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks


def test_min_tokens_banning_every_token_is_refused_naming_the_field(llm):
    vocab = llm.engine.info.hf_config.vocab_size
    params = SamplingParams(temperature=0.7, min_tokens=2, max_tokens=4, stop_token_ids=list(range(vocab)))
    with pytest.raises(SamplingParamsError) as info:
        llm.engine.add_request("ban", llm.encode(PROMPT), params)
    assert info.value.field == "min_tokens"
    # Without min_tokens the same stop list is legal: the first token stops it.
    out = llm.generate([PROMPT], SamplingParams(temperature=0.7, max_tokens=4,
                                                stop_token_ids=list(range(vocab))))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1


def test_first_tokens_from_prefill_get_the_colocated_text_and_stop_rules(llm):
    """The decode side of prefill -> decode: tokens sampled elsewhere are
    detokenized and stop-checked here, so an emoji's first bytes are held
    back and a stop string that begins in the first token does not leak."""
    engine = llm.engine
    for prompt, stop in [("Reply with only one emoji for a happy face.", []),
                         ("Say exactly this and nothing else: hi there!", ["Hello there"]),
                         ("Say exactly this and nothing else: hi there!", ["there!"])]:
        ids = llm.chat_prompt([{"role": "user", "content": prompt}])
        params = SamplingParams(temperature=0, max_tokens=8, stop=stop)
        colocated = llm.generate([ids], params)[0].outputs[0]
        engine.add_request("split", ids, params, first_token_ids=colocated.token_ids[:1])
        outputs = _drain(engine)["split"]
        assert "".join(o.new_text for o in outputs) == colocated.text
        assert [t for o in outputs for t in o.new_token_ids] == colocated.token_ids
        assert outputs[-1].finish_reason == colocated.finish_reason
        assert "\ufffd" not in outputs[0].new_text


def test_max_tokens_one_finishes_on_the_first_token_without_a_step(llm):
    ids = llm.encode(PROMPT)
    llm.engine.add_request("one", ids, SamplingParams(temperature=0, max_tokens=1), first_token_ids=[42])
    assert not llm.engine.scheduler.has_unfinished()  # never scheduled: nothing to compute
    [out] = llm.engine.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == [42]


def test_an_engine_whose_loop_dies_fails_every_caller_and_says_so():
    deaths: list[BaseException] = []
    engine = AsyncLLMEngine(None, engine=LLM("smollm2").engine, on_death=deaths.append)

    async def run() -> None:
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        stream = engine.generate("long", engine.tokenizer.encode(PROMPT), params)
        await stream.__anext__()
        engine.inject_fault("test")
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.generate("late", [1, 2, 3], params).__anext__()

    try:
        asyncio.run(run())
        assert not engine.is_alive and len(deaths) == 1
    finally:
        engine.shutdown()


def test_a_failed_request_reaches_its_async_caller_and_the_loop_lives_on(llm):
    engine = AsyncLLMEngine(None, engine=llm.engine)

    async def run() -> None:
        ids = llm.encode(PROMPT)
        params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True)
        stream = engine.generate("poison", ids, params)
        await stream.__anext__()
        params.repetition_penalty = SUBNORMAL  # past validation, read by the next step
        with pytest.raises(RequestFailedError) as info:
            async for _ in stream:
                pass
        assert "repetition_penalty" in str(info.value) and info.value.caused_by_request
        outs = [o async for o in engine.generate("after", ids, SamplingParams(temperature=0, max_tokens=3))]
        assert outs[-1].finish_reason == "length"

    try:
        asyncio.run(run())
        assert engine.is_alive
    finally:
        engine.shutdown()
