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
    # Only the bursts explore: 5 steps after 16 leader steps, then (the leader
    # twice as fast, so the pause quadruples) after 64, then 256.
    assert policies.count(False) == 5 * 3
    assert policies[-100:].count(False) <= 5


def test_it_stops_speculating_where_plain_decoding_is_faster_and_explores_less_and_less():
    g = SpeculationGovernor()
    policies = run_steps(g, 2000, 64, by_rate(900.0, 1000.0, batch=64), [0.0])
    assert g.leaders() == {64: False}
    assert g.counts.leader_changes == 1
    assert policies[:16] == [True] * 16, "it starts with what the user asked for"
    assert policies[16:21] == [False] * 5, "then tries the other policy for a burst"
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
    policies = run_steps(g, 10, 40, by_rate(800.0, 1000.0, batch=40), clock)
    assert policies == [False] * 10, "32-63 took 64-127's choice"
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
