"""Routing policies: which instance of a tier gets a request.

A policy sees only healthy instances (never an empty list) and the request's
prompt; it keeps no per-request state, so the router can swap policies per
tier. Pure logic, testable without a network.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence


class Routable(Protocol):
    """What a policy needs to know of an instance (backends.Instance has it)."""

    target: str

    def load_score(self) -> tuple: ...


@dataclass(frozen=True)
class RouteRequest:
    prompt_token_ids: Sequence[int]


class Policy(Protocol):
    name: str

    def choose(self, instances: Sequence[Routable], request: RouteRequest) -> Routable: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, instances: Sequence[Routable], request: RouteRequest) -> Routable:
        # Sorted so the order does not depend on how membership changed.
        ordered = sorted(instances, key=lambda i: i.target)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoaded:
    """The instance with the smallest load_score(): outstanding prefill tokens
    for prefill, running requests then KV usage for decode (see backends)."""

    name = "least_loaded"

    def choose(self, instances: Sequence[Routable], request: RouteRequest) -> Routable:
        return min(instances, key=lambda i: (i.load_score(), i.target))


class PrefixAffinity:
    """Requests whose prompts start with the same `affinity_tokens` tokens go to
    the same instance, so its local prefix cache serves them.

    Rendezvous hashing: each (prefix, instance) pair gets a score and the
    highest wins, so an instance joining or leaving moves only its own share
    of prefixes. Prompts shorter than the prefix carry no shared prefix worth
    keeping together and go to the least loaded instance.
    """

    name = "prefix_affinity"

    def __init__(self, affinity_tokens: int = 16) -> None:
        if affinity_tokens < 1:
            raise ValueError("affinity_tokens must be at least 1")
        self.affinity_tokens = affinity_tokens
        self._fallback = LeastLoaded()

    def prefix_key(self, prompt_token_ids: Sequence[int]) -> bytes | None:
        if len(prompt_token_ids) < self.affinity_tokens:
            return None
        head = prompt_token_ids[: self.affinity_tokens]
        return hashlib.sha256(b",".join(str(t).encode() for t in head)).digest()

    def choose(self, instances: Sequence[Routable], request: RouteRequest) -> Routable:
        key = self.prefix_key(request.prompt_token_ids)
        if key is None:
            return self._fallback.choose(instances, request)

        def score(instance: Routable) -> bytes:
            return hashlib.sha256(key + instance.target.encode()).digest()

        return max(instances, key=score)


POLICIES = ("round_robin", "least_loaded", "prefix_affinity")


def make_policy(name: str, affinity_tokens: int = 16) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_affinity":
        return PrefixAffinity(affinity_tokens)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
