"""Routing policies pick instances as documented, without a network."""
from __future__ import annotations

from dataclasses import dataclass
from collections import Counter

import pytest

from tandem.services.router.policies import (LeastLoaded, PrefixAffinity, RoundRobin, RouteRequest,
                                             make_policy)

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeInstance:
    """Policies only read .target and .load_score(); plain data, no network."""

    target: str
    score: tuple = (0,)

    def load_score(self) -> tuple:
        return self.score


def instances(n: int) -> list[FakeInstance]:
    return [FakeInstance(f"10.0.0.{i}:50071") for i in range(n)]


def test_round_robin_cycles_through_every_instance():
    policy = RoundRobin()
    pool = instances(3)
    picks = [policy.choose(pool, RouteRequest([1, 2, 3])).target for _ in range(9)]
    assert Counter(picks) == {i.target: 3 for i in pool}
    assert picks[:3] != [picks[0]] * 3


def test_least_loaded_picks_the_smallest_score():
    pool = [FakeInstance("a:1", (5, 0.1)), FakeInstance("b:1", (2, 0.9)), FakeInstance("c:1", (2, 0.3))]
    assert LeastLoaded().choose(pool, RouteRequest([1])).target == "c:1"


def test_prefix_affinity_sends_a_shared_prefix_to_one_instance():
    policy = PrefixAffinity(affinity_tokens=16)
    pool = instances(4)
    prefix = list(range(100, 116))
    targets = {policy.choose(pool, RouteRequest(prefix + [i, i + 1])).target for i in range(20)}
    assert len(targets) == 1


def test_prefix_affinity_spreads_different_prefixes():
    policy = PrefixAffinity(affinity_tokens=16)
    pool = instances(4)
    picks = Counter(policy.choose(pool, RouteRequest([p] * 16)).target for p in range(200))
    assert len(picks) == 4 and min(picks.values()) > 20


def test_prefix_affinity_moves_only_the_share_of_a_removed_instance():
    policy = PrefixAffinity(affinity_tokens=16)
    pool = instances(4)
    before = {p: policy.choose(pool, RouteRequest([p] * 16)).target for p in range(200)}
    gone = pool[0].target
    after = {p: policy.choose(pool[1:], RouteRequest([p] * 16)).target for p in range(200)}
    moved = [p for p in before if before[p] != after[p]]
    assert moved and all(before[p] == gone for p in moved)


def test_prefix_affinity_sends_short_prompts_to_the_least_loaded():
    pool = [FakeInstance("a:1", (3,)), FakeInstance("b:1", (1,))]
    assert PrefixAffinity(16).choose(pool, RouteRequest([1, 2, 3])).target == "b:1"


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_affinity"):
        make_policy("random")
