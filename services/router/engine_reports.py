"""What the router validates requests against: the model id, context length
(max_model_len) and KV block size its engines report in every GetLoad (each
health round), never a copy of its own.

- The context limit is the smallest max_model_len among the healthy
  instances of both tiers: a request must fit every tier it may cross.
- The engines' model id is what /v1/models and ListModels show and what a
  request's `model` must name (or one of the router's aliases).
- While no healthy instance has reported, there is no view: requests and
  /v1/models get 503 with Retry-After (gRPC UNAVAILABLE).
- Every instance must serve the model the healthy ones serve: one that
  reports another model id is kept out of its pool (unhealthy, with a
  last_error that says so) and logged as an error. When none is healthy, the
  first to report sets the model.
- Likewise its KV blocks: an instance whose blocks are named otherwise (its
  kv_key: the weights' dtype or quantization, --kv-cache-dtype) or hold
  another number of tokens is kept out. Its KV would never load in the others
  nor theirs in it: a decode behind such a prefill recomputes every prompt.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from tandem.services.router.backends import BackendPool, Instance
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelView:
    model_id: str
    max_model_len: int  # prompt + output tokens
    block_size: int  # tokens per KV block; 0: not reported


def reports_model(load: common_pb2.Load) -> bool:
    # Engines before the Load fields existed (and tests' fakes) report neither.
    return bool(load.model_id) and load.max_model_len > 0


class EngineReports:
    def __init__(self, router_model_id: str, pools: Sequence[BackendPool] = ()) -> None:
        self.router_model_id = router_model_id  # what the router's --model names (its tokenizer)
        self.pools = list(pools)
        self._last: Optional[ModelView] = None

    def watch(self, pool: BackendPool) -> BackendPool:
        """Take `pool`'s reports into the view, and keep its instances that
        serve another model than the others out of it."""
        pool.vet = self.vet
        self.pools.append(pool)
        return pool

    def _reporting(self, exclude: Optional[Instance] = None) -> list[Instance]:
        return [i for pool in self.pools for i in pool.healthy()
                if i is not exclude and reports_model(i.load)]

    def view(self) -> Optional[ModelView]:
        """The engines' model now, or None while no healthy instance has reported."""
        reporting = self._reporting()
        if not reporting:
            return None
        first = reporting[0].load
        view = ModelView(first.model_id, min(i.load.max_model_len for i in reporting), first.block_size)
        if view != self._last:
            self._on_change(view)
        return view

    def _on_change(self, view: ModelView) -> None:
        self._last = view
        log.info("the engines serve %r: context %d tokens, KV blocks of %d tokens",
                 view.model_id, view.max_model_len, view.block_size)
        if view.model_id != self.router_model_id:
            log.warning("the engines serve %r but the router's --model names %r: the router's tokenizer "
                        "and chat template may not be theirs; start the router with the engines' --model "
                        "(and --tokenizer)", view.model_id, self.router_model_id)

    def vet(self, instance: Instance, load: common_pb2.Load) -> Optional[str]:
        """Why `instance` must take no requests, given what it reports; None: it may."""
        if not load.model_id:
            return None
        others = self._reporting(exclude=instance)
        served = {i.load.model_id for i in others}
        if served and load.model_id not in served:
            return (f"it serves model {load.model_id!r} but the other instances serve "
                    f"{' and '.join(map(repr, sorted(served)))}; restart it with their --model, or stop "
                    "the others")
        if not load.kv_key:
            return None
        blocks = {_kv_blocks(i.load) for i in others if i.load.kv_key}
        if not blocks or _kv_blocks(load) in blocks:
            return None
        return (f"its KV blocks are {_kv_blocks(load)} but the other instances' are "
                f"{' and '.join(sorted(blocks))}: neither could load the other's KV, so every prompt "
                "would be computed again; restart it with their --dtype, --quantization, "
                "--kv-cache-dtype and --block-size")


def _kv_blocks(load: common_pb2.Load) -> str:
    return f"{load.kv_key!r} of {load.block_size} tokens"
