"""The adaptive speculation governor (engine/spec_decode/governor.py) on step
timings given as data: it keeps the policy that decodes faster at each
batch size, finds out when the other one becomes faster, measures only
decode steps (under speculation only those that verified drafts), and
leaves out the transitions into and out of a burst and outliers."""
from __future__ import annotations

from typing import Callable

from tandem.engine.spec_decode.governor import GovernorSettings, SpeculationGovernor


def run_steps(governor: SpeculationGovernor, steps: int, num_running: int,
              cost: Callable[[bool], tuple], clock: list[float], decode_only: bool = True) -> list[bool]:
    """`steps` engine steps at this batch, each decided, run and timed as the
    engine does: cost(policy) -> (tokens emitted, seconds taken[, whether
    it verified drafts: by default, whether it speculated])."""
    policies = []
    for _ in range(steps):
        policy = governor.decide(num_running)
        policies.append(policy)
        governor.step_started(clock[0])
        tokens, seconds, *verified = cost(policy)
        governor.step_ran(clock[0], decode_only, tokens, verified[0] if verified else policy)
        clock[0] += seconds
    governor.step_started(clock[0])
    return policies


def by_rate(speculate_per_s: float, plain_per_s: float, batch: int = 8):
    """A workload where speculating emits 3 tokens a row and plain 1, at these rates."""
    def cost(policy: bool) -> tuple[int, float]:
        tokens = batch * (3 if policy else 1)
        return tokens, tokens / (speculate_per_s if policy else plain_per_s)
    return cost


def test_it_keeps_speculating_where_speculation_is_faster():
    g = SpeculationGovernor()
    policies = run_steps(g, 600, 1, by_rate(2000.0, 1000.0, batch=1), [0.0])
    assert g.leaders() == {1: True}
    assert g.counts.leader_changes == 0
    # Only the bursts explore: 5 steps after 8 leader steps, then (the leader
    # twice as fast, so the pause quadruples) after 32, 128, then 256.
    assert policies.count(False) == 5 * 4
    assert policies[-100:].count(False) <= 5


def test_it_stops_speculating_where_plain_decoding_is_faster_and_explores_less_and_less():
    g = SpeculationGovernor()
    policies = run_steps(g, 2000, 64, by_rate(900.0, 1000.0, batch=64), [0.0])
    assert g.leaders() == {64: False}
    assert g.counts.leader_changes == 1
    assert g.report()[0].startswith("batch 64+: plain, leader 1000 tok/s")
    assert policies[:8] == [True] * 8, "it starts with what the user asked for"
    assert policies[8:13] == [False] * 5, "then tries the other policy for a burst"
    assert policies[-1000:].count(True) <= 4 * 5, "a burst of 5 every 256 steps at most, once settled"
    # A 3% margin: 10% faster wins, 2% faster does not flip a leader.
    g2 = SpeculationGovernor()
    run_steps(g2, 400, 64, by_rate(980.0, 1000.0, batch=64), [0.0])
    assert g2.leaders() == {64: True}


def test_each_batch_size_group_decides_alone():
    g = SpeculationGovernor()
    clock = [0.0]
    for _ in range(20):  # interleaved, as a draining batch is not, to show the groups are separate
        run_steps(g, 10, 1, by_rate(2000.0, 1000.0, batch=1), clock)
        run_steps(g, 10, 40, by_rate(800.0, 1000.0, batch=40), clock)
    assert g.leaders() == {1: True, 32: False}
    assert SpeculationGovernor.group_of(1) != SpeculationGovernor.group_of(2)
    assert SpeculationGovernor.group_of(32) == SpeculationGovernor.group_of(63)


def test_a_new_batch_size_starts_with_the_nearest_measured_choice():
    """A batch draining from 64 requests reaches sizes the governor has not
    seen: each starts with what the nearest measured size chose, and still
    finds out for itself where that is wrong."""
    g = SpeculationGovernor()
    clock = [0.0]
    run_steps(g, 200, 64, by_rate(800.0, 1000.0, batch=64), clock)
    assert g.leaders() == {64: False}
    policies = run_steps(g, 8, 40, by_rate(800.0, 1000.0, batch=40), clock)
    assert policies == [False] * 8, "32-63 took 64-127's choice"
    run_steps(g, 300, 20, by_rate(2000.0, 1000.0, batch=20), clock)
    assert g.leaders() == {16: True, 32: False, 64: False}, "and 16-31 learned its own"
    assert SpeculationGovernor().decide(8) is True, "with nothing measured: speculate"


def test_a_change_of_workload_is_found_and_followed():
    g = SpeculationGovernor()
    clock = [0.0]
    run_steps(g, 600, 16, by_rate(800.0, 1000.0, batch=16), clock)
    assert g.leaders() == {16: False}
    # Answers now quote their prompts: speculating becomes twice as fast.
    policies = run_steps(g, 600, 16, by_rate(2000.0, 1000.0, batch=16), clock)
    assert g.leaders() == {16: True}
    assert policies[-100:].count(True) >= 95


def alternating(verify: tuple[int, float], no_drafts: tuple[int, float], every: int):
    """Speculation that finds drafts at one step in `every` (verify: tokens,
    seconds), and none at the others (no_drafts: tokens, seconds); plain
    decoding 1 token a millisecond."""
    n = {"i": 0}

    def cost(policy: bool):
        if not policy:
            return 1, 1e-3
        n["i"] += 1
        return (*verify, True) if n["i"] % every == 0 else (*no_drafts, False)
    return cost


def test_steps_without_drafts_are_charged_their_overhead_not_their_tokens():
    """One request whose answer has a copied stretch now and then (a verifying
    step: 5 tokens in 2 ms, 2.5x plain's rate) and changed words between
    (steps without drafts). Those steps decode what plain decoding would;
    what speculation costs there is only the lookup's overhead. Small, and
    one verifying step in five repays it: speculation stays. Large (2 ms
    more a token), it does not: plain decoding leads."""
    g = SpeculationGovernor()
    policies = run_steps(g, 400, 1, alternating((5, 2e-3), (1, 1.1e-3), every=5), [0.0])
    assert g.leaders() == {1: True} and policies.count(True) > 380
    g = SpeculationGovernor()
    run_steps(g, 400, 1, alternating((5, 2e-3), (1, 3e-3), every=5), [0.0])
    assert g.leaders() == {1: False}


def test_only_decode_steps_are_measured():
    """Steps with prompt chunks do not count: were they measured, the slow
    prefill steps under one policy would make it look slower."""
    g = SpeculationGovernor()
    clock = [0.0]

    def slow_when_speculating(policy: bool) -> tuple[int, float]:
        return 8, (1.0 if policy else 0.01)

    run_steps(g, 300, 8, slow_when_speculating, clock, decode_only=False)
    assert g.leaders() == {8: True}
    assert g.counts.speculate_steps == g.counts.plain_steps == 0


def test_a_bursts_first_step_and_outliers_are_not_measured():
    """Switching into a burst costs once (the asynchronous pipeline drains
    or fills): that step is left out, as is a step far longer than its
    policy's mean (a collection pause)."""
    g = SpeculationGovernor()
    clock = [0.0]
    state = {"last": True}

    def transition_costs(policy: bool) -> tuple[int, float]:
        # Plain is 10% faster in steady state, but its first step after a switch costs 5x
        # (below the outlier rule's 10x, so only the transition rule leaves it out).
        switched = policy != state["last"]
        state["last"] = policy
        seconds = 0.009 if not policy else 0.010
        return 10, seconds * (5 if switched and not policy else 1)

    run_steps(g, 400, 4, transition_costs, clock)
    assert g.leaders() == {4: False}

    g = SpeculationGovernor()
    clock = [0.0]
    n = {"i": 0}

    def one_huge_pause(policy: bool) -> tuple[int, float]:
        n["i"] += 1
        if policy and n["i"] == 5:
            return 10, 5.0  # 500x a step: a pause, not the policy's cost
        return 10, 0.010 if policy else 0.0105

    run_steps(g, 400, 4, one_huge_pause, clock)
    assert g.leaders() == {4: True}


def test_a_burst_whose_last_step_went_unmeasured_still_counts():
    """A prompt chunk in a burst's last step leaves it unmeasured; the burst's
    other steps are taken when the next burst begins, so a group whose
    bursts always end so still finds the faster policy."""
    g = SpeculationGovernor()
    clock = [0.0]
    for _ in range(400):
        policy = g.decide(8)
        g.step_started(clock[0])
        group = g._groups[SpeculationGovernor.group_of(8)]
        last_of_burst = group.burst_open and group.burst_left == 0 and policy != group.leader
        tokens = 8 * (3 if policy else 1)
        g.step_ran(clock[0], not last_of_burst, tokens, policy)
        clock[0] += tokens / (800.0 if policy else 1000.0)
    assert g.leaders() == {8: False}


def test_forget_decision_measures_nothing_of_the_next_step():
    g = SpeculationGovernor(GovernorSettings())
    g.decide(4)
    g.forget_decision()
    g.step_started(0.0)
    g.step_ran(0.0, True, 10, True)
    g.step_started(1.0)
    assert g.counts.speculate_steps == g.counts.plain_steps == 0


# ---- shadow lookups: bursts of speculation predicted to lose are skipped ----

def per_row(tokens_a_row: list[float], batch: int = 64):
    """Speculating costs 3 ms a step and emits tokens_a_row[0] tokens a row
    (a list, so a test can change it); plain decoding 1.25 ms and one a row.
    At 1.2 tokens a row speculation runs at half plain's rate."""
    def cost(policy: bool) -> tuple[int, float]:
        if policy:
            return round(batch * tokens_a_row[0]), 3e-3
        return batch, 1.25e-3
    return cost


def run_with_shadow(governor: SpeculationGovernor, steps: int, cost, shadow_tokens_a_row: list[float],
                    clock: list[float], batch: int = 64) -> list[bool]:
    """run_steps, with each shadow lookup the governor asks for resolved at
    once: a speculating step would have emitted shadow_tokens_a_row[0] a row."""
    policies = []
    for _ in range(steps):
        policy = governor.decide(batch)
        if governor.wants_shadow():
            governor.shadow_resolved(round(batch * shadow_tokens_a_row[0]), batch)
        policies.append(policy)
        governor.step_started(clock[0])
        tokens, seconds = cost(policy)
        governor.step_ran(clock[0], True, tokens, policy, rows=batch)
        clock[0] += seconds
    governor.step_started(clock[0])
    return policies


def test_a_burst_the_shadow_predicts_to_lose_is_skipped_but_not_forever():
    """Answers that quote nothing: speculating runs at half plain's rate, and
    the shadow lookups see the same 1.2 tokens a row it had then. Bursts of
    speculation would only lose again, so most are skipped; one in
    max_skipped + 1 still runs."""
    tokens = [1.2]
    g = SpeculationGovernor()
    policies = run_with_shadow(g, 4000, per_row(tokens), tokens, [0.0])
    assert g.leaders() == {64: False}
    assert g.counts.shadow_lookups > 0 and g.counts.skipped_bursts >= 4
    settled = policies[-2600:]
    assert 1 <= sum(1 for a, b in zip(settled, settled[1:]) if b and not a) <= 2, \
        "a burst every (max_skipped + 1) x 256 leader steps"
    # The same without shadow data: every due burst runs.
    g = SpeculationGovernor()
    policies = run_steps(g, 4000, 64, per_row(tokens), [0.0])
    assert g.counts.skipped_bursts == 0
    assert policies[-2600:].count(True) >= 5 * 9


def test_a_burst_runs_once_the_shadow_sees_drafts_accepted():
    """Plain leads while speculation loses; then the answers start quoting
    their prompts (3.5 tokens a row: speculation 1.46x plain). The shadow
    sees it, the next due burst runs, and speculation leads again long
    before the skip limit would have forced a burst."""
    tokens = [1.2]
    g = SpeculationGovernor()
    clock = [0.0]
    run_with_shadow(g, 2000, per_row(tokens), tokens, clock)
    assert g.leaders() == {64: False}
    skipped = g.counts.skipped_bursts
    assert skipped >= 2
    tokens[0] = 3.5
    policies = run_with_shadow(g, 600, per_row(tokens), tokens, clock)
    assert g.leaders() == {64: True}
    assert policies[-100:].count(True) >= 90
    assert g.counts.skipped_bursts == skipped, "no burst skipped once the shadow predicts a gain"


def test_a_shadow_lookup_counts_what_verifying_its_drafts_would_emit():
    """Speculator.shadow on real requests and prompt lookup: a row emits one
    token plus the drafts that match the tokens that then came, counted
    only once all of them came (or the request ended); a row without drafts
    emits one. Nothing is proposed to the requests themselves."""
    from tandem.engine.request import Request, RequestStatus, SamplingParams
    from tandem.engine.spec_decode.config import SpeculativeConfig
    from tandem.engine.spec_decode.ngram_proposer import NgramProposer
    from tandem.engine.spec_decode.speculator import Speculator

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                               prompt_lookup_max=4)
    speculator = Speculator(config, NgramProposer(2, 4))
    params = SamplingParams(temperature=0, max_tokens=50)
    quoting = Request("quoting", [1, 2, 3, 4, 5, 6, 1, 2, 3], params)  # looks up 4, 5, 6, 1
    fresh = Request("fresh", [7, 8, 9, 10], params)  # nothing to look up
    ending = Request("ending", [11, 12, 13, 11, 12], params)  # looks up 13, 11, 12, 13
    for r in (quoting, fresh, ending):
        r.status = RequestStatus.RUNNING
    speculator.shadow([quoting, fresh, ending])
    assert quoting.spec_token_ids == [] and ending.spec_token_ids == []
    governor = speculator.governor
    for token in (4, 5):
        quoting.append_token(token)
    ending.append_token(13)
    ending.status = RequestStatus.FINISHED_STOPPED  # its one token matched, then it ended
    speculator.check_shadows()
    assert governor.counts.shadow_lookups == 0, "two of quoting's four drafts are still to come"
    for token in (9, 1):  # the third draft (6) misses
        quoting.append_token(token)
    speculator.check_shadows()
    assert governor.counts.shadow_lookups == 1
    # quoting: 1 + 2 matched; fresh: 1; ending: its one token (1 + 1 matched, cut where it ended).
    assert governor.shadow_tokens_per_row == (3 + 1 + 1) / 3


def test_the_first_burst_after_plain_takes_the_lead_runs_whatever_the_shadow_says():
    """Speculation is 1.46x plain (3.5 tokens a row), but the first plain
    burst runs on a fast moment of the host (its steps 4x faster) and takes
    the lead. The shadow then sees the same 3.5 tokens a row speculation had
    at that comparison, so it predicts the loss measured then; one
    comparison can be noise, so the next burst still runs, and speculation
    takes the lead back."""
    tokens = [3.5]
    cost = per_row(tokens)
    plain_steps = {"n": 0}

    def fast_first_plain_burst(policy: bool) -> tuple[int, float]:
        n_tokens, seconds = cost(policy)
        if not policy:
            plain_steps["n"] += 1
            if plain_steps["n"] <= 5:
                seconds /= 4
        return n_tokens, seconds

    g = SpeculationGovernor()
    policies = run_with_shadow(g, 200, fast_first_plain_burst, tokens, [0.0])
    assert policies[8:13] == [False] * 5 and g.counts.leader_changes == 2
    assert g.leaders() == {64: True}
    assert policies[-100:].count(True) >= 90


def test_steps_beside_a_prompt_chunk_are_decided_and_measured_apart():
    """Decode-only steps speculate faster (3 tokens a row in 2 ms against
    plain's 1 in 1 ms); steps that also carry a newcomer's prompt chunk
    verify slowly (3 tokens a row in 8 ms against 1 in 1.5 ms). Each such
    step is decided at its start (decide_beside_prompt, after the decode
    decision made at the end of the step before) and measured only as the
    kind it was decided as: the decode groups keep speculating, the groups
    beside a chunk drop their drafts."""
    g = SpeculationGovernor()
    clock = [0.0]
    beside_policies = []
    for i in range(1200):
        policy = g.decide(8)
        beside = i % 3 == 0  # every third step carries a prompt chunk
        if beside and policy:
            policy = g.decide_beside_prompt(8)
            beside_policies.append(policy)
        g.step_started(clock[0])
        tokens = 8 * (3 if policy else 1)
        seconds = (8e-3 if policy else 1.5e-3) if beside else (2e-3 if policy else 1e-3)
        g.step_ran(clock[0], not beside, tokens, policy, rows=8)
        clock[0] += seconds
    g.step_started(clock[0])
    assert g.leaders() == {8: True}
    assert g.leaders_beside_prompt() == {8: False}
    assert beside_policies[-100:].count(True) <= 10
    assert any("beside a prompt chunk: plain" in line for line in g.report())
    # Without a decode decision (speculation off for the step), drafts stay and nothing is measured.
    assert SpeculationGovernor().decide_beside_prompt(8) is True
