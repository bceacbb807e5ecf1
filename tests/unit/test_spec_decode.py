"""Speculative decoding on the embedded SmolLM2 (CPU, fp32): greedy output is
token for token the output without it, for a batch of mixed lengths with a
stop string, EOS, max_tokens, logprobs and a grammar in it, whether the
proposals come from prompt lookup, from SmolLM2 drafting for itself (which
must accept nearly everything) or from a random-weight draft of SmolLM2's
vocabulary (which must accept almost nothing). The KV of rejected tokens
never leaks: a next turn that reuses, through the prefix cache, blocks filled
while most drafts were rejected answers as a fresh engine does."""
from __future__ import annotations

import pytest

from tandem.engine import LLM, SamplingParams, StructuredOutputs
from tests.support.hf_oracle import tiny_model_dir

MAX_TOKENS = 24
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed "
        "how knowledge moved across Europe. Before it, books were copied by hand, slowly and at great "
        "cost. Scholars, merchants and clergy all felt the change within a generation. ")
# "adaptive": False: these tests check what verifying does, so every step that
# can carry drafts must, whether or not speculation pays on this CPU (the
# governor has tests of its own below).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "adaptive": False}


@pytest.fixture(scope="module")
def base():
    return LLM()


@pytest.fixture(scope="module")
def workload(base):
    """Prompts of mixed lengths (4 to 150 tokens) and what the engine without
    speculation answers; one answer ends at a stop string taken from its middle."""
    tok = base.tokenizer
    prompts = [
        tok(f"Repeat this text exactly.\nText: {TEXT}\nRepeated text: The history")["input_ids"],
        tok("Once upon a time")["input_ids"],
        tok(TEXT * 3)["input_ids"][:150],
        base.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]),
        tok("Count: one, two, three, four,")["input_ids"],
        tok("Name three colors:")["input_ids"],
    ]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    params[3] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)  # ends with EOS
    params[5] = SamplingParams(temperature=0, max_tokens=8,
                               structured_outputs=StructuredOutputs(choice=["red, green, blue", "none"]))
    refs = base.generate(prompts, params)
    # A stop string from the middle of the copied answer: it lands inside an accepted run.
    copied = refs[0].outputs[0].text
    stop = copied[len(copied) // 2:len(copied) // 2 + 6]
    params[0] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True)
    refs[0] = base.generate([prompts[0]], params[0])[0]
    assert refs[0].outputs[0].finish_reason == "stop" and refs[3].outputs[0].finish_reason == "stop"
    return prompts, params, refs


def assert_same_output(outputs, refs) -> None:
    for out, ref in zip(outputs, refs):
        ours, theirs = out.outputs[0], ref.outputs[0]
        assert ours.token_ids == theirs.token_ids
        assert (ours.text, ours.finish_reason, ours.stop_reason) == (theirs.text, theirs.finish_reason,
                                                                     theirs.stop_reason)
        assert [lp.token_id for lp in ours.logprobs] == [lp.token_id for lp in theirs.logprobs]
        assert [lp.logprob for lp in ours.logprobs] == pytest.approx([lp.logprob for lp in theirs.logprobs],
                                                                     abs=1e-4)


def spec_counters(llm: LLM) -> tuple[int, int, int, int]:
    s = llm.engine.stats()
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens,
            s.spec_decode_num_emitted_tokens)


def assert_all_blocks_back(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
    proposer = engine.speculator.proposer
    if hasattr(proposer, "kv"):
        assert proposer.num_states == 0
        assert proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_usable_blocks


@pytest.fixture(scope="module")
def ngram():
    # 17 usable blocks: the workload's first three requests take 16 to start and need more as they
    # decode; greedy admission starts them all (reserving for their outputs would not).
    return LLM(speculative_config=NGRAM, num_blocks=18, admission="greedy")


def test_prompt_lookup_gives_the_same_output_through_preemption(workload, ngram):
    prompts, params, refs = workload
    llm = ngram
    outputs = llm.generate(prompts, params)
    assert_same_output(outputs, refs)
    assert llm.engine.stats().num_preemptions > 0
    drafts, draft_tokens, accepted, emitted = spec_counters(llm)
    assert accepted > 10, "the copied text is proposed and accepted"
    assert emitted > drafts, "steps with proposals emit more than one token on average"
    assert_all_blocks_back(llm)


def test_prompt_lookup_under_asynchronous_scheduling_defers_plain_steps_and_answers_the_same(workload):
    """Steps without drafts leave their tokens in flight; a lookup one token
    behind makes the engine wait for them and propose, so drafts still come."""
    prompts, params, refs = workload
    llm = LLM(speculative_config=NGRAM, num_blocks=18, async_scheduling="on", admission="greedy")
    engine = llm.engine
    assert engine.async_scheduling
    tokens: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
        tokens[str(i)] = []
    deferred = verifying = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        deferred += engine._inflight is not None
        verifying += engine.step_times.draft_tokens > 0
    assert [tokens[str(i)] for i in range(len(prompts))] == [r.outputs[0].token_ids for r in refs]
    assert deferred > 3, "steps without drafts go asynchronously"
    assert verifying > 3, "and drafts are still proposed and verified"
    assert engine.stats().num_preemptions > 0
    assert_all_blocks_back(llm)
    assert_same_output(llm.generate(prompts, params), refs)


def test_a_request_aborted_while_its_text_waits_gets_no_more_output(workload):
    """Under asynchronous scheduling a verifying step's text comes with the
    next step (Scheduler.take_text); a request aborted in between gets none
    of it, and gives every block back."""
    prompts, _, _ = workload
    llm = LLM(speculative_config=NGRAM, async_scheduling="on")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("copy", prompts[0], params)
    engine.add_request("other", prompts[2], params)
    for _ in range(200):
        engine.step()
        if engine.scheduler._untexted:
            break
    assert engine.scheduler._untexted, "a verifying step left its text for the next"
    engine.abort("copy")
    seen: list[str] = []
    while engine.has_unfinished():
        seen += [out.request_id for out in engine.step()]
    assert "copy" not in seen and "other" in seen
    assert_all_blocks_back(llm)


def test_sampled_requests_speculate_too(workload, ngram):
    prompts, _, _ = workload
    llm = ngram
    before = spec_counters(llm)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts[:2], params)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    assert spec_counters(llm)[1] > before[1]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)] == \
        [o.outputs[0].token_ids for o in outputs], "a seed makes the output reproducible"


def test_smollm2_drafting_for_itself_accepts_nearly_everything(workload):
    prompts, params, refs = workload
    llm = LLM(speculative_config={"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 4,
                                  "adaptive": False})
    outputs = llm.generate(prompts, params)
    assert_same_output(outputs, refs)
    drafts, draft_tokens, accepted, emitted = spec_counters(llm)
    assert accepted >= 0.9 * draft_tokens > 0
    assert emitted < accepted + drafts, "the stop string cut an accepted run"
    assert_all_blocks_back(llm)


def test_heads_outer_blocks_under_a_draft_model_answer_the_same(workload):
    """--kv-cache-layout HND under speculation: the verifying steps write and
    read the target's heads-outer cache, and the draft's cache is heads-outer too."""
    prompts, params, refs = workload
    llm = LLM(kv_cache_layout="HND", speculative_config={"method": "draft_model", "model": "smollm2",
                                                         "num_speculative_tokens": 4, "adaptive": False})
    assert not llm.engine.runner.kv_cache.is_contiguous()
    assert not llm.engine.speculator.proposer.runner.kv_cache.is_contiguous()
    outputs = llm.generate(prompts, params)
    assert_same_output(outputs, refs)
    drafts, draft_tokens, accepted, emitted = spec_counters(llm)
    assert accepted >= 0.9 * draft_tokens > 0
    assert_all_blocks_back(llm)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("draft"), "llama", vocab_size=49152)
    return LLM(speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                  "adaptive": False})


def test_a_random_draft_accepts_little_and_changes_nothing(workload, random_draft):
    prompts, params, refs = workload
    before = spec_counters(random_draft)
    outputs = random_draft.generate(prompts, params)
    assert_same_output(outputs, refs)
    drafts, draft_tokens, accepted, _ = (a - b for a, b in zip(spec_counters(random_draft), before))
    assert draft_tokens > 100 and accepted < 0.1 * draft_tokens
    assert_all_blocks_back(random_draft)


def test_blocks_filled_among_rejected_drafts_serve_a_next_turn_unchanged(base, workload, random_draft):
    """A next turn hits, through the prefix cache, the blocks the random draft's
    request filled while nearly all its drafts were rejected: had a block kept
    a rejected token's KV, or been named for one, this answer would differ."""
    prompts, _, _ = workload
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = random_draft.generate([prompts[2]], greedy)[0].outputs[0].token_ids
    follow_up = prompts[2] + first + base.tokenizer(" In short,")["input_ids"]
    ours = random_draft.generate([follow_up], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    want = base.generate([follow_up], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ours.num_cached_tokens >= (len(prompts[2]) + 32) // 16 * 16, "blocks filled by decoding were reused"
    assert ours.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_abort_mid_speculation_gives_every_block_back(workload, random_draft):
    prompts, _, _ = workload
    engine = random_draft.engine
    engine.add_request("gone", prompts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.speculator.proposer.num_states == 1
    engine.abort("gone")
    assert not engine.has_unfinished()
    assert_all_blocks_back(random_draft)


def test_a_draft_of_another_vocabulary_is_refused_before_the_model_loads(tmp_path):
    from tandem.engine import ConfigError

    path, _ = tiny_model_dir(tmp_path, "llama")  # 512 tokens
    with pytest.raises(ConfigError, match="--speculative-config: the draft model .* its vocabulary has 512"):
        LLM(speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})


# ---- adaptive speculation (the default): the governor on the real engine ----

def governed(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return (s.spec_decode_governed_speculate_steps, s.spec_decode_governed_plain_steps,
            s.spec_decode_governor_changes)


def test_the_governor_keeps_speculating_where_drafts_are_accepted(workload):
    """One request copying its prompt: prompt lookup's drafts are nearly all
    accepted, a verifying step emits about four tokens for little more than
    a plain step's cost, so the governor keeps speculating (its plain bursts
    measure slower) and the output is the engine's own. Under asynchronous
    scheduling, so that its decisions also steer the lookup one token behind."""
    prompts, _, _ = workload
    llm = LLM(speculative_config={k: v for k, v in NGRAM.items() if k != "adaptive"}, async_scheduling="on")
    assert llm.engine.speculator.governor is not None, "adaptive is the default"
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    ours = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    speculate, plain, _ = governed(llm)
    # Step times on the CI's two busy cores vary threefold, so a burst can
    # mislead it for a while; what must hold is that most steps speculated.
    assert plain >= 5, "it tried decoding plainly for a burst"
    assert speculate > plain
    assert spec_counters(llm)[2] > 40, "drafts were proposed and accepted"
    base = LLM(async_scheduling="on")
    assert ours == base.generate([prompts[0]], params)[0].outputs[0].token_ids


def test_the_governor_stops_speculating_where_drafts_are_rejected(workload, tmp_path):
    """A random-weight draft: nearly every draft is rejected, so a verifying
    step emits about one token a request and costs the draft's forwards and
    four rows a request. The governor measures plain decoding faster and
    keeps most steps plain, with bursts of speculation that find nothing
    better; the output is the engine's own. Eight drafts a step (36 rows a
    verifying step against a plain step's 4, and seven draft forwards):
    speculation then takes about three times a plain step's time on this
    CPU. Step times on the CI's two busy cores vary threefold, so one burst
    can mislead; the governor explores every 4-16 steps here (its settings,
    not its rule, are the test's), and most steps must be plain."""
    from tandem.engine.spec_decode.governor import GovernorSettings, SpeculationGovernor

    prompts, _, _ = workload
    path, _ = tiny_model_dir(tmp_path, "llama", vocab_size=49152)
    llm = LLM(speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 8})
    llm.engine.speculator.governor = SpeculationGovernor(GovernorSettings(first_pause=4, max_pause=16))
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    batch = prompts[:4]  # 4 running: one group of batch sizes (4-7) throughout
    ours = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    speculate, plain, changes = governed(llm)
    assert changes >= 1
    assert plain > speculate
    drafts_before = spec_counters(llm)[1]
    assert drafts_before > 0, "it speculated before it knew better"
    base = LLM()
    assert ours == [o.outputs[0].token_ids for o in base.generate(batch, params)]
    assert_all_blocks_back(llm)
    # The decode role's /metrics series, from these stats.
    from prometheus_client import REGISTRY

    from tandem.services.common.engine_metrics import EngineMetrics

    EngineMetrics(llm.engine, "decode").poll()
    labels = {"role": "decode", "model": llm.engine.model_id}
    exported = [REGISTRY.get_sample_value("tandem:spec_decode_governed_steps_total", {**labels, "policy": p})
                for p in ("speculate", "plain")]
    assert exported == [speculate, plain]
    assert REGISTRY.get_sample_value("tandem:spec_decode_governor_changes_total", labels) == changes


def test_shadow_lookups_see_what_speculating_would_accept_and_change_no_token(workload):
    """A governor that has seen speculation lose at batch 1 (steps given as
    data: a third of plain's rate, one token a row) decodes plainly and,
    before its next burst of speculation, looks up drafts in the shadow:
    asked every step here (its settings). The answer starts by copying its
    prompt, so each of the first lookups must count 5 tokens: 4 drafts, all
    of them what plain decoding then produced, and the target's own token
    after them. A lookup checked one position off would count 1. Under
    asynchronous scheduling, where the lookup runs one token behind; and
    the output is the engine's own."""
    from tandem.engine.spec_decode.governor import GovernorSettings, SpeculationGovernor

    prompts, _, _ = workload
    llm = LLM(speculative_config={k: v for k, v in NGRAM.items() if k != "adaptive"}, async_scheduling="on")
    governor = SpeculationGovernor(GovernorSettings(shadow_window=10_000, shadow_every=1))
    _teach_plain(governor, speculating_s=3e-3, beside_prompt=False)
    assert governor.leaders() == {1: False}
    resolved: list[tuple[int, int]] = []
    record = governor.shadow_resolved

    def recorded(tokens: int, rows: int) -> None:
        resolved.append((tokens, rows))
        record(tokens, rows)

    governor.shadow_resolved = recorded
    llm.engine.speculator.governor = governor
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    assert resolved[:3] == [(5, 1)] * 3
    assert governor.counts.skipped_bursts == 0, "a shadow that sees drafts accepted lets the burst run"
    base = LLM(async_scheduling="on")
    assert ours == base.generate([prompts[0]], params)[0].outputs[0].token_ids


def test_the_step_after_a_request_finishes_is_decided_for_the_batch_that_ran(workload):
    """Two requests, one ending long before the other: each step's decision
    for the next is made for the batch that step ran (its sampled
    requests), so the step in which the short one ends still decides for 2,
    not 1: in a server a newcomer takes its place next."""
    prompts, _, _ = workload
    llm = LLM(speculative_config={k: v for k, v in NGRAM.items() if k != "adaptive"})
    speculator = llm.engine.speculator
    governor = speculator.governor
    decided: list[int] = []
    ran: list[int] = []
    decide, step_ran = governor.decide, speculator.step_ran

    def recorded_decide(num_running: int) -> bool:
        decided.append(num_running)
        return decide(num_running)

    def recorded_step(start: float, plan, num_accepted: int) -> None:
        ran.append(len(plan.sampled))
        step_ran(start, plan, num_accepted)

    governor.decide, speculator.step_ran = recorded_decide, recorded_step
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    llm.generate([prompts[1], prompts[4]], params)
    assert 2 in ran and 1 in ran
    assert decided == ran


def test_drafts_are_dropped_beside_a_prompt_chunk_where_that_group_found_plain_faster(workload):
    """A request copying its prompt speculates; a second arrives while it
    runs. The governor has seen verifying steps beside a prompt chunk lose
    (steps given as data), so the step that carries the newcomer's prompt
    drops the drafts proposed for it, while the decode-only steps around it
    keep speculating; that step is decided in the group of the two requests
    it runs; the outputs are the engine's own."""
    from tandem.engine.spec_decode.governor import SpeculationGovernor

    prompts, _, _ = workload
    llm = LLM(speculative_config={k: v for k, v in NGRAM.items() if k != "adaptive"})
    governor = SpeculationGovernor()
    _teach_plain(governor, speculating_s=5e-3, beside_prompt=True)
    assert governor.leaders_beside_prompt() == {1: False}
    engine = llm.engine
    engine.speculator.governor = governor
    plans: list[tuple[bool, int]] = []
    step_ran = engine.speculator.step_ran

    def recorded(start: float, plan, num_accepted: int) -> None:
        plans.append((plan.has_no_prompt_chunk, sum(plan.num_draft_tokens) if plan.num_draft_tokens else 0))
        step_ran(start, plan, num_accepted)

    engine.speculator.step_ran = recorded
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("copying", prompts[0], params)
    tokens: dict[str, list[int]] = {"copying": [], "newcomer": []}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 2:
            engine.add_request("newcomer", prompts[2], params)
    beside = [drafts for decode_only, drafts in plans[1:] if not decode_only]  # [0]: the first prompt
    assert beside and all(d == 0 for d in beside), "the step with the newcomer's prompt verified no drafts"
    assert any(d > 0 for decode_only, d in plans if decode_only), "decode-only steps still speculated"
    # Decided for the two requests that step runs (the decision before it was for one).
    assert 2 in governor.leaders_beside_prompt()
    base = LLM()
    refs = base.generate([prompts[0], prompts[2]], params)
    assert tokens["copying"] == refs[0].outputs[0].token_ids
    assert tokens["newcomer"] == refs[1].outputs[0].token_ids


def _teach_plain(governor, speculating_s: float, beside_prompt: bool) -> None:
    """40 steps at batch 1 given as data: speculating decodes 1 token in
    speculating_s, plain 1 in 1 ms, so the group learns PLAIN (the group of
    decode-only steps, or of steps beside a prompt chunk)."""
    clock = 0.0
    for _ in range(40):
        policy = governor.decide(1)
        if beside_prompt:
            policy = governor.decide_beside_prompt(1)
        governor.step_started(clock)
        governor.step_ran(clock, not beside_prompt, 1, policy, rows=1)
        clock += speculating_s if policy else 1e-3
    governor.step_started(clock)
