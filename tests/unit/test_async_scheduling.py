"""Asynchronous scheduling (engine/llm_engine.py, step): each step is
scheduled and queued before the last one's sampled tokens are taken, its
inputs reading those tokens where they are. Forced on here on the CPU,
where it changes only the order of the work, the engine must answer
exactly as it does step by step: through every stop rule (a stopped request
computes one token more, which is dropped), seeded sampling, logprobs,
requests that need each token on the host (penalties, min_tokens, a
grammar: those steps run in turn), preemption, aborts and the KV store."""
from __future__ import annotations

import pytest

from tandem.engine import LLM, SamplingParams, StructuredOutputs
from tandem.engine.llm_engine import LLMEngine

PROMPTS = ["The capital of France is", "Water boils at", "def fibonacci(n):",
           "Once upon a time, in a quiet village,", "List three colors:", "The year is",
           "Q: What is two plus two?\nA:", "Dear diary,"]


def mixed_params(tokenizer) -> list[SamplingParams]:
    """One of each: greedy to EOS, stop strings, stop ids, max_tokens at once,
    seeded sampling with logprobs, penalties, min_tokens, a grammar."""
    common = dict(temperature=0.0, max_tokens=24)
    stop_id = tokenizer(" the")["input_ids"][0]
    return [SamplingParams(temperature=0.0, max_tokens=60),  # likely ends at EOS
            SamplingParams(stop=[".", "\n"], **common),
            SamplingParams(stop_token_ids=[stop_id], **common),
            SamplingParams(temperature=0.0, max_tokens=1),
            SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, logprobs=3),
            SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, **common),
            SamplingParams(min_tokens=6, **common),
            SamplingParams(structured_outputs=StructuredOutputs(choice=["yes", "no"]), **common)]


def answers(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             [(lp.token_id, round(lp.logprob, 4), sorted(lp.top)) for lp in o.outputs[0].logprobs])
            for o in outputs]


@pytest.fixture(scope="module")
def engines():
    sync = LLM("smollm2", async_scheduling="off", num_blocks=400)
    overlapped = LLM("smollm2", async_scheduling="on", num_blocks=400)
    assert not sync.engine.async_scheduling and overlapped.engine.async_scheduling
    yield sync, overlapped
    sync.shutdown()
    overlapped.shutdown()


def test_every_stop_rule_sampling_and_the_requests_that_need_each_token_answer_the_same(engines):
    sync, overlapped = engines
    params = mixed_params(sync.tokenizer)
    expected = answers(sync.generate(PROMPTS, params))
    assert answers(overlapped.generate(PROMPTS, params)) == expected
    reasons = {a[2] for a in expected}
    assert {"stop", "length"} <= reasons  # the stop rules really ended some early
    pool = overlapped.engine.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and overlapped.engine._inflight is None


def test_plain_batches_overlap_and_stopped_requests_drop_their_extra_token(engines):
    _, overlapped = engines
    engine: LLMEngine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["."])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"plain{i}", overlapped.encode(prompt), params)
    before = engine.stats().generation_tokens
    deferred = 0
    tokens: dict[str, list[int]] = {f"plain{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        outputs = engine.step()
        deferred += engine._inflight is not None
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    assert deferred > 10, "plain greedy steps leave their tokens in flight"
    sync, _ = engines
    reference = sync.generate(PROMPTS, params)
    assert [tokens[f"plain{i}"] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in reference]
    # generation_tokens counts taken tokens only, not the dropped extra ones
    assert engine.stats().generation_tokens - before == sum(len(o.outputs[0].token_ids) for o in reference)


def test_a_request_aborted_while_its_token_is_in_flight_frees_everything(engines):
    sync, overlapped = engines
    engine: LLMEngine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"abort{i}", overlapped.encode(prompt), params)
    outputs: dict[str, list[int]] = {f"abort{i}": [] for i in range(4)}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 6:
            assert engine._inflight is not None and "abort1" in {r.request_id for r in engine._inflight.requests}
            engine.abort("abort1")
    reference = sync.generate(PROMPTS[:4], params)
    assert [outputs[f"abort{i}"] for i in (0, 2, 3)] == [reference[i].outputs[0].token_ids for i in (0, 2, 3)]
    assert len(outputs["abort1"]) < 30
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_the_kv_store_connector_loads_and_saves_under_asynchronous_scheduling(tmp_path):
    from tandem.services.kvstore.block_client import BlockStoreClient
    from tests.support.kvstore_process import start_store

    store = start_store("--backend", "memory", "--capacity", "64MiB")
    try:
        prompts = [p * 6 for p in PROMPTS[:3]]  # several full blocks each
        params = SamplingParams(temperature=0.0, max_tokens=12)
        texts = []
        for _ in range(2):  # the second engine finds every full block in the store
            llm = LLM("smollm2", async_scheduling="on", num_blocks=200, kv_transfer="store", kv_role="both",
                      kv_store=BlockStoreClient(store.target, timeout_s=10.0))
            texts.append([o.outputs[0].text for o in llm.generate(prompts, params)])
            stats = llm.engine.stats()
            llm.shutdown()
        assert texts[0] == texts[1] and stats.kv_load_blocks > 0 and stats.recompute_fallbacks == 0
    finally:
        store.stop()


def test_a_request_that_preempts_itself_in_a_step_that_runs_nothing_comes_back_on_its_own_blocks(tmp_path):
    """Two usable blocks. The first request's last token is in flight, so
    nothing is scheduled for it; the second needs a block for its next token,
    finds none and preempts itself: the plan runs nothing and never reaches
    the runner. Its freed id must still reach the runner with the next plan,
    or the second request comes back onto its old block list."""
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama", lm_head_scale=8.0)
    prompts = [list(range(2, 17)), list(range(20, 36))]  # 15 and 16 tokens: one block each
    params = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    answers = {}
    for mode in ("off", "on"):
        llm = LLM(path, async_scheduling=mode, num_blocks=3, admission="greedy")  # both start at once
        outputs = llm.generate(prompts, params)
        answers[mode] = [o.outputs[0].token_ids for o in outputs]
        if mode == "on":
            assert llm.engine.stats().num_preemptions > 0, "the test must make the second request preempt itself"
    assert answers["on"] == answers["off"]
