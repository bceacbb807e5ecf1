"""The plan of one engine step: plain data from the scheduler to the model runner.

Entry i says: request `request_ids[i]` computes `num_new_tokens[i]` tokens,
from position `num_computed_tokens[i]` on (tokens before it are in the KV
cache). The runner keeps a persistent block-table row per request; an entry
carries only the block ids its request got since it was last planned (all of
them when it is new, or resumed after a preemption), and `freed_request_ids`
names the requests whose blocks went back since the last plan, so the runner
drops their rows before it reads the entries. Nothing here refers to a
Request object: the plan can be copied to another process as it is (tensor
parallel workers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


# Stands in token_ids for a token sampled by the step in flight (a real id,
# so the inputs stay valid; the runner writes the token over it).
PENDING_TOKEN = 0


@dataclass
class SchedulerOutput:
    request_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    # The tokens computed this step, entries concatenated in order: the model's input ids.
    token_ids: list[int] = field(default_factory=list)
    # Entries whose step reaches their request's last known token, in order:
    # their logits are sampled.
    sampled: list[int] = field(default_factory=list)
    # Speculative decoding, aligned with `sampled` (empty when no entry of the
    # step carries draft tokens): sampled entry j's tokens end with
    # num_draft_tokens[j] proposed tokens after its last known one, and the
    # logits of all its last 1 + num_draft_tokens[j] rows are computed, in
    # order, to verify them.
    num_draft_tokens: list[int] = field(default_factory=list)
    freed_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Host KV tier copies (kv_swapper.py), made before the step's forward and
    # before the connector's loads: every (device block, host slot) swap-out
    # first (a preempted request's blocks, evicted cached blocks), then every
    # (host slot, device block) swap-in. A device block freed and reused in
    # this step is thus read before it is written; a slot read this step is
    # never written this step (the tier keeps it referenced until the next plan).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The KV connector's whole job for this step (loads, saves), or None.
    connector_meta: Optional[object] = None
    # Asynchronous scheduling: entries whose last input token was sampled by
    # the step still in flight (token_ids holds PENDING_TOKEN there), and
    # that token's row among that step's sampled tokens, aligned. The runner
    # fills those inputs on the device.
    pending_entries: list[int] = field(default_factory=list)
    pending_rows: list[int] = field(default_factory=list)

    @property
    def num_entries(self) -> int:
        return len(self.request_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids

    @property
    def num_logits_rows(self) -> int:
        """Rows of logits the step computes: one per sampled entry, plus its draft tokens."""
        return len(self.sampled) + sum(self.num_draft_tokens)

    @property
    def has_no_prompt_chunk(self) -> bool:
        """Every entry decodes or verifies its drafts: each samples, and the
        step computes only the rows it takes logits of."""
        return len(self.sampled) == self.num_entries and self.num_scheduled_tokens == self.num_logits_rows

    @property
    def is_decode_only(self) -> bool:
        """Every entry computes one token (one row per request)."""
        return len(self.token_ids) == len(self.request_ids)
