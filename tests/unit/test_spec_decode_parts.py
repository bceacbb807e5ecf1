"""Speculative decoding's parts, without a model: the scheduler's side (draft
tokens count against the token budget, never preempt, roll back exactly the
rejected ones, and no KV of a rejected token ever sits in a block the prefix
cache names), the rejection sampler (greedy keeps the argmax; sampled keeps
the target's distribution), prompt lookup, and the speculative_config flag."""
from __future__ import annotations

import argparse
import collections
import random

import numpy as np
import pytest
import torch

from tandem.engine.block_hash import extend_block_hashes
from tandem.engine.config import ConfigError, EngineArgs, SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.engine.spec_decode.ngram_proposer import TOKEN_BYTES, NgramProposer, encode, propose_ngram
from tandem.engine.spec_decode.rejection_sampler import RejectionSampler, accept_greedy

BS = 4  # tokens per block: drafts cross block boundaries often
STOP = 999


def target_token(sequence: list[int]) -> int:
    """A stand-in target model: its greedy next token is a function of the whole prefix."""
    return (sum(sequence) * 31 + len(sequence) * 7) % 500 + 2


class FakeKV:
    """What each cache slot holds: the token whose K/V a step wrote there."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, sched: Scheduler, plan) -> None:
        tokens = iter(plan.token_ids)
        for rid, start, n in zip(plan.request_ids, plan.num_computed_tokens, plan.num_new_tokens):
            block_ids = sched.requests[rid].block_ids
            for pos in range(start, start + n):
                self.slots[(block_ids[pos // BS], pos % BS)] = next(tokens)

    def block(self, block_id: int) -> list:
        return [self.slots.get((block_id, i)) for i in range(BS)]


def verify_step(sched: Scheduler, plan, kv: FakeKV) -> None:
    """One engine step minus the model: the greedy target verifies each entry's drafts."""
    kv.write(sched, plan)
    if not sched.sampling_drafts:  # no entry carries drafts: the ordinary update
        tokens = [target_token(r.all_token_ids) for r in sched.sampling_requests]
        sched.update(tokens, [None] * len(tokens), {})
        return
    tokens, accepted = [], []
    for request, drafts in zip(sched.sampling_requests, sched.sampling_drafts):
        seq = list(request.all_token_ids)
        best = []
        for d in [*drafts, None]:
            best.append(target_token(seq))
            seq.append(d)
        out = accept_greedy(best, drafts)
        tokens.append(out)
        accepted.append(len(out) - 1)
    sched.update_verified(tokens, [[None] * len(t) for t in tokens], accepted, {})


def propose(sched: Scheduler, rng: random.Random, k: int = 4) -> None:
    """Drafts, right or wrong at random, for every running request."""
    for request in sched.running:
        seq, drafts = list(request.all_token_ids), []
        for _ in range(rng.randrange(1, k + 1)):
            right = target_token(seq)
            drafts.append(right if rng.random() < 0.6 else rng.randrange(2, 500))
            seq.append(drafts[-1])
        request.spec_token_ids = drafts


def test_rejected_drafts_roll_back_and_named_blocks_hold_only_accepted_tokens():
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                      KVCacheManager(num_blocks=200, block_size=BS))
    kv = FakeKV()
    requests = [Request(f"r{i}", [rng.randrange(2, 500) for _ in range(n)], SamplingParams(max_tokens=30))
                for i, n in enumerate((3, 9, 17, 4))]
    for r in requests:
        sched.add_request(r)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        assert plan.num_scheduled_tokens <= 64
        verify_step(sched, plan, kv)
        for r in requests:
            if r.is_finished:
                continue
            # Every computed position holds its own token's KV; rejected drafts' do not count.
            assert r.num_computed_tokens == r.num_tokens - 1
            assert all(kv.slots[(r.block_ids[p // BS], p % BS)] == r.all_token_ids[p]
                       for p in range(r.num_computed_tokens))
        propose(sched, rng)
    assert all(r.is_finished and r.num_output_tokens == 30 for r in requests)
    assert sched.stats.spec_num_draft_tokens > sched.stats.spec_num_accepted_tokens > 0
    # What the target alone would have produced, token for token.
    for r in requests:
        seq = list(r.prompt_token_ids)
        for _ in range(30):
            seq.append(target_token(seq))
        assert r.all_token_ids == seq
    # Every block the prefix cache names holds the KV of exactly the tokens its hash names.
    named = {}
    for r in requests:
        hashes = extend_block_hashes([], r.all_token_ids, BS)
        for i, h in enumerate(hashes):
            named[h] = r.all_token_ids[i * BS:(i + 1) * BS]
    cached = sched.kv.pool.cached
    assert len(cached) > 20
    for block_hash, block in cached.items():
        assert block_hash in named, "a block is named by tokens no request has"
        assert kv.block(block.block_id) == named[block_hash]
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_a_stop_token_inside_an_accepted_run_cuts_the_rest():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(num_blocks=20, block_size=BS))
    r = Request("r", [5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[STOP]))
    sched.add_request(r)
    sched.schedule()
    sched.update([10], [None], {})
    r.spec_token_ids = [11, STOP, 13, 14]
    plan = sched.schedule()
    assert plan.num_new_tokens == [5] and plan.token_ids == [10, 11, STOP, 13, 14]
    assert plan.num_draft_tokens == [4]
    # All four accepted, then the target's own token: the stop ends it after two.
    outs = sched.update_verified([[11, STOP, 13, 14, 15]], [[None] * 5], [4], {})
    assert outs[0].new_token_ids == [11, STOP] and outs[0].finish_reason == "stop"
    assert r.output_token_ids == [10, 11, STOP] and r.status is RequestStatus.FINISHED_STOPPED
    assert sched.stats.spec_num_accepted_tokens == 4 and sched.stats.spec_num_emitted_tokens == 2
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_max_tokens_inside_an_accepted_run_cuts_the_rest():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(num_blocks=20, block_size=BS))
    r = Request("r", [5, 6, 7], SamplingParams(max_tokens=3))
    sched.add_request(r)
    sched.schedule()
    sched.update([10], [None], {})
    r.spec_token_ids = [11, 12, 13]
    sched.schedule()
    outs = sched.update_verified([[11, 12, 13, 14]], [[None] * 4], [3], {})
    assert outs[0].new_token_ids == [11, 12] and outs[0].finish_reason == "length"


def test_draft_tokens_count_against_the_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), KVCacheManager(num_blocks=40, block_size=BS))
    reqs = [Request(f"r{i}", [5 + i, 6], SamplingParams(max_tokens=50)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    sched.update([7, 7, 7], [None] * 3, {})
    for r in reqs:
        r.spec_token_ids = [1, 2, 3, 4, 5]
    plan = sched.schedule()
    # 1 + 5, then 1 + 3 (the budget's rest); the third waits for the next step.
    assert plan.num_new_tokens == [6, 4] and plan.num_draft_tokens == [5, 3]
    assert plan.num_scheduled_tokens == 10 and plan.num_logits_rows == 10


def test_draft_tokens_never_preempt_anyone():
    # Three blocks: each request holds one, with room for its next token; drafts would need more.
    # Greedy admission starts all three (reserving for their outputs would start one).
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, admission="greedy"),
                      KVCacheManager(num_blocks=4, block_size=BS))
    reqs = [Request(f"r{i}", [5 + i, 6], SamplingParams(max_tokens=50)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    sched.update([7, 7, 7], [None] * 3, {})
    for r in reqs:
        r.spec_token_ids = [1, 2, 3, 4]
    plan = sched.schedule()
    assert not plan.preempted_request_ids
    assert plan.num_new_tokens == [1, 1, 1] and not plan.num_draft_tokens


def test_greedy_acceptance_keeps_the_argmax():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert accept_greedy([3, 5], [4]) == [3]


def test_rejection_sampling_keeps_the_targets_distribution():
    """The first token's distribution is p_1 whatever the draft; after an
    accepted draft the next is p_2. 6,000 verifications, 3 sigma."""
    vocab = 5
    sampler = Sampler(vocab)
    verify = RejectionSampler(sampler)
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.5, -1.0], [0.0, 0.5, 2.0, 0.0, 1.0]])
    p1, p2 = torch.softmax(logits[0], -1), torch.softmax(logits[1], -1)
    r = Request("r", [1, 2], SamplingParams(temperature=1.0, seed=7, max_tokens=10))
    first, second = collections.Counter(), collections.Counter()
    n = 6000
    draft = 3
    for _ in range(n):
        out = verify(logits.clone(), [r], [[draft]])
        tokens = out.token_ids[0]
        first[tokens[0]] += 1
        if out.num_accepted[0] == 1:
            assert tokens[0] == draft and len(tokens) == 2
            second[tokens[1]] += 1
    for token in range(vocab):
        p = float(p1[token])
        assert abs(first[token] / n - p) < 3 * (p * (1 - p) / n) ** 0.5 + 1e-3, (token, first)
    m = sum(second.values())
    for token in range(vocab):
        p = float(p2[token])
        assert abs(second[token] / m - p) < 3 * (p * (1 - p) / m) ** 0.5 + 1e-3, (token, second)


@pytest.mark.parametrize("tokens, lo, hi, k, want", [
    ([1, 2, 3, 4, 5, 1, 2, 3], 1, 3, 3, [4, 5, 1]),  # the longest suffix (1 2 3) found in the prompt
    ([1, 2, 3, 4, 5, 9, 2, 3], 1, 3, 3, [4, 5, 9]),  # (9 2 3) is nowhere else: (2 3) is
    ([1, 2, 1, 2, 1, 2], 2, 2, 5, [1, 2, 1, 2, 1]),  # a loop is copied on past the end
    ([5, 1, 5, 2, 5], 1, 3, 2, [2, 5]),  # the latest occurrence
    ([1, 2, 3], 1, 3, 2, []),  # no earlier occurrence
    ([1, 2, 3, 1], 2, 3, 2, []),  # only shorter than prompt_lookup_min
])
def test_prompt_lookup_proposes_what_followed_the_suffix(tokens, lo, hi, k, want):
    assert propose_ngram(tokens, lo, hi, k) == want
    assert propose_ngram(tokens, lo, hi, k, bytearray(encode(tokens))) == want


def _lookup_by_definition(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The rule read literally: for n from hi down to lo, the latest earlier
    window equal to the last n tokens with a token after it; copy on from there."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                out: list[int] = []
                for i in range(k):
                    pos = start + n + i
                    out.append(tokens[pos] if pos < len(tokens) else out[pos - len(tokens)])
                return out
    return []


def test_prompt_lookup_follows_its_rule_on_random_sequences():
    rng = random.Random(11)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        k = rng.randrange(0, 7)
        assert propose_ngram(tokens, lo, hi, k) == _lookup_by_definition(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_prompt_lookup_skips_byte_matches_that_straddle_two_tokens():
    """The search runs over the tokens' bytes: the needle's bytes may also
    appear across a token boundary, which is no token match."""
    assert TOKEN_BYTES == 4
    little = np.little_endian
    a, b = (16777216, 2) if little else (1, 33554432)  # bytes 00 00 00 01 | 02 00 00 00 (little-endian)
    x = 513 if little else 16908288  # bytes 01 02 00 00: at byte 3 of a, b
    assert encode([a, b]).find(encode([x])) == 3
    assert propose_ngram([a, b, 5, x], 1, 1, 2) == []  # x occurs earlier only across a | b
    # the aligned occurrence at 0, before the straddling one, is the match
    assert propose_ngram([x, 7, a, b, 5, x], 1, 2, 2) == [7, a]
    rng = random.Random(12)
    values = (0, 1, 256, 65536, a, b, x, 257)
    for _ in range(3000):
        tokens = [rng.choice(values) for _ in range(rng.randrange(1, 30))]
        lo = rng.randrange(1, 3)
        hi = lo + rng.randrange(0, 3)
        k = rng.randrange(1, 5)
        assert propose_ngram(tokens, lo, hi, k) == _lookup_by_definition(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_the_ngram_proposer_keeps_each_requests_tokens_up_to_date():
    rng = random.Random(3)
    proposer = NgramProposer(1, 3)
    r = Request("r", [rng.randrange(2, 9) for _ in range(5)], SamplingParams())
    for _ in range(300):  # grows past its buffer more than once
        assert proposer.propose([r], [3]) == [_lookup_by_definition(r.all_token_ids, 1, 3, 3)]
        r.all_token_ids.append(rng.randrange(2, 9))
    again = Request("r", [4, 5, 4], SamplingParams())  # a new request under the same id
    assert proposer.propose([again], [2]) == [[5, 4]]
    proposer.forget(["r"])
    assert proposer._tokens == {}


def parse(*argv: str) -> EngineArgs:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return EngineArgs.from_cli_args(p.parse_args(list(argv)))


def test_speculative_config_as_vllm_takes_it(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("TANDEM_"):
            monkeypatch.delenv(key)
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    spec = parse("--speculative-config", text).create_engine_config().speculative
    assert spec == SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)
    monkeypatch.setenv("TANDEM_SPECULATIVE_CONFIG", '{"model": "smollm2", "num_speculative_tokens": 2}')
    args = parse()
    assert args.create_engine_config().speculative == SpeculativeConfig("draft_model", 2, model="smollm2")
    # LLM(speculative_config={...}) and a child's command line carry the same JSON.
    from_dict = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert "--speculative-config" in from_dict.to_cli_args()
    assert from_dict.create_engine_config().speculative.prompt_lookup_min == 5  # vLLM's default
    assert EngineArgs().create_engine_config().speculative is None


@pytest.mark.parametrize("value, says", [
    ("{not json", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "from 1 to 32"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not supported"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs model"),
    ('{"num_speculative_tokens": 2}', "give method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "must not exceed"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}', "unknown key"),
    ('{"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "for method 'ngram'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "at least 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "8"}', "at least 1"),
])
def test_a_bad_speculative_config_names_what_is_wrong(value, says):
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        EngineArgs(speculative_config=value).create_engine_config()
    assert says in str(err.value)


def test_disable_by_batch_size_proposes_only_while_few_requests_run(tmp_path):
    """vLLM's disable_by_batch_size: with more requests running than it, steps
    carry no drafts (a large batch decodes plainly); with fewer, they do; the
    greedy tokens are the same either way."""
    import random

    from tandem.engine import LLM, SamplingParams
    from tests.support.hf_oracle import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama")
    rng = random.Random(2)
    prompts = [[5, 6, 7, 8] * 10] + [[rng.randrange(2, 512) for _ in range(20)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 2, "adaptive": False}
    assert SpeculativeConfig.parse(spec).disable_by_batch_size == 2
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=256, speculative_config=spec)
    plain = LLM(path, device="cpu", dtype="float32", num_blocks=256)
    try:
        many = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # 4 running > 2
        assert llm.engine.stats().spec_decode_num_drafts == 0
        one = llm.generate(prompts[:1], params)[0].outputs[0].token_ids  # 1 running <= 2
        assert llm.engine.stats().spec_decode_num_drafts > 0
        assert many == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        assert one == many[0]
    finally:
        llm.shutdown()
        plain.shutdown()
