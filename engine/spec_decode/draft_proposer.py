"""Draft-model proposals: a smaller model of the same tokenizer runs in the
engine's process over its own paged KV cache and proposes k tokens by k
greedy steps.

The draft keeps, per request, a shadow Request in its own KVCacheManager:
its tokens are the target's (accepted tokens only), num_computed_tokens
counts the positions whose draft KV holds them. Proposing k tokens writes
the KV of d_1..d_{k-1} past the sequence (`written`); at the next proposal
those that the target accepted are still the sequence's and are kept, the
rest are written again: the same num_computed_tokens rule as the target's,
and blocks are named in the draft's prefix cache only within accepted
tokens. One proposal is one forward over the tokens the draft has not seen
(the target's last step: its accepted drafts and its own token; a whole
prompt for a request new to the draft, in chunks under the step's token
budget) and k - 1 one-token forwards, each batched over every request.

The draft's cache has as many blocks as the target's (each target block is
sized with a draft block beside it), so whatever the target holds the draft
can hold too; when it cannot (prefix sharing differs), the request simply
decodes without proposals until blocks come back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.model_runner import ModelRunner
from tandem.engine.plan import SchedulerOutput
from tandem.engine.request import Request
from tandem.engine.scheduler import NO_BLOCK_IDS

log = logging.getLogger(__name__)


@dataclass
class _DraftState:
    target: Request  # the request proposed for (a new one under the same id starts over)
    shadow: Request  # its tokens and blocks in the draft's cache
    written: list[int] = field(default_factory=list)  # drafts whose KV follows shadow's computed tokens
    hits: list = field(default_factory=list)  # a new state's prefix-cache hits, taken at its first allocation


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, vocab_size: int, max_model_len: int, token_budget: int) -> None:
        """runner: the draft model's, its cache not yet bound (bind()).
        vocab_size: the ids it may propose (the target's vocabulary)."""
        self.runner = runner
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.token_budget = token_budget  # tokens one catch-up forward computes, at most
        self.kv: KVCacheManager = None  # type: ignore[assignment]  # bind()
        self._states: dict[str, _DraftState] = {}
        self._freed: list[str] = []  # for the next plan's freed_request_ids (the runner's rows)

    @property
    def block_bytes(self) -> int:
        return self.runner.layout.block_bytes

    def bind(self, num_blocks: int, max_model_len: int, enable_caching: bool) -> None:
        """Allocate the draft's KV cache: num_blocks blocks (the target's number)."""
        runner = self.runner
        runner.set_num_blocks(num_blocks)
        runner.bind_kv_cache()
        layout = runner.layout
        self.kv = KVCacheManager(num_blocks, layout.block_size, enable_caching,
                                 hash_extra=layout.model_key.encode())
        self.max_model_len = min(self.max_model_len, max_model_len, (num_blocks - 1) * layout.block_size)
        runner.warm_up_kernels(self.max_model_len)
        runner.enable_cuda_graphs(self.max_model_len)

    @property
    def num_states(self) -> int:
        return len(self._states)

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests' blocks went back in the target: their draft state goes too."""
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                self.kv.free(state.shadow)
                self._freed.append(request_id)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to num_tokens[i] greedy draft tokens to follow requests[i]'s tokens."""
        out: list[list[int]] = [[] for _ in requests]
        plan = SchedulerOutput(freed_request_ids=self._freed)
        self._freed = []
        ready: list[tuple[int, _DraftState, int]] = []  # (index in requests, state, k) of sampled entries
        budget = self.token_budget
        for i, (request, k) in enumerate(zip(requests, num_tokens)):
            # d_1..d_{k-1} are written at positions num_tokens .. num_tokens + k - 2.
            k = min(k, self.max_model_len - request.num_tokens + 1)
            if k <= 0 or budget <= 0:
                continue
            state = self._sync(request)
            shadow, hits = state.shadow, state.hits
            start = shadow.num_computed_tokens + len(hits) * self.kv.block_size
            num_new = shadow.num_tokens - start
            complete = num_new <= budget
            if not complete:
                num_new = budget  # a long catch-up (a prompt new to the draft): in chunks, no proposal yet
            added = self.kv.allocate_slots(shadow, num_new + (k - 1 if complete else 0), hits)
            if added is None:  # the draft's cache is full: decode without proposals for now
                self.forget([request.request_id])
                continue
            state.hits = []
            budget -= num_new
            plan.request_ids.append(request.request_id)
            plan.num_computed_tokens.append(start)
            plan.num_new_tokens.append(num_new)
            plan.new_block_ids.append([b.block_id for b in added] if added else NO_BLOCK_IDS)
            plan.token_ids.extend(shadow.all_token_ids[start:start + num_new])
            shadow.num_computed_tokens = start + num_new
            state.written = []
            if complete:
                plan.sampled.append(len(plan.request_ids) - 1)
                ready.append((i, state, k))
        if plan.is_empty:
            if plan.freed_request_ids:
                self._freed = plan.freed_request_ids + self._freed  # no plan ran: the next one carries them
            return out
        drafts = self._greedy(plan)
        for (i, _, _), token in zip(ready, drafts):
            out[i].append(token)
        # k - 1 more steps of one token each, over the requests that want them.
        for step in range(1, max((k for _, _, k in ready), default=0)):
            active = [(i, state) for i, state, k in ready if k > step]
            plan = SchedulerOutput(sampled=list(range(len(active))))
            for i, state in active:
                plan.request_ids.append(state.target.request_id)
                plan.num_computed_tokens.append(state.shadow.num_tokens + step - 1)
                plan.num_new_tokens.append(1)
                plan.new_block_ids.append(NO_BLOCK_IDS)
                plan.token_ids.append(out[i][-1])
                state.written.append(out[i][-1])
            for (i, _), token in zip(active, self._greedy(plan)):
                out[i].append(token)
        return out

    def _sync(self, request: Request) -> _DraftState:
        """The request's draft state, its tokens brought up to the target's and
        its progress over the drafts the target accepted."""
        state = self._states.get(request.request_id)
        if state is not None and state.target is not request:
            self.forget([request.request_id])  # another request under the same id
            state = None
        if state is None:
            shadow = Request(request.request_id, request.prompt_token_ids, request.params,
                             output_token_ids=request.output_token_ids)
            hits, _ = self.kv.get_computed_blocks(shadow)
            state = self._states[request.request_id] = _DraftState(request, shadow, hits=hits)
            return state
        shadow, tokens = state.shadow, request.all_token_ids
        shadow.all_token_ids.extend(tokens[shadow.num_tokens:])
        # Drafts the target accepted are the sequence's now, KV and all; the
        # last token is always computed again (its logits propose d_1).
        computed = shadow.num_computed_tokens
        for token in state.written:
            if computed >= len(tokens) - 1 or tokens[computed] != token:
                break
            computed += 1
        shadow.num_computed_tokens = computed
        state.written = []
        return state

    def _greedy(self, plan: SchedulerOutput) -> list[int]:
        logits = self.runner.execute(plan)
        if logits is None:
            return []
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()
