"""The engine: add_request / step / abort.

One step = schedule -> (load KV) -> run the model -> (save KV) -> sample
(or verify draft tokens) -> the scheduler's update (stop rules, text,
outputs) -> (propose the next draft tokens). All of it runs on one thread;
the asyncio wrapper for services lives in async_engine.py, the offline
`LLM.generate` in llm.py.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

from tandem.engine.config import EngineConfig
from tandem.engine.connector.base import KVCacheLayout, KVConnector, KVStore
from tandem.engine.detokenizer import Detokenizer
from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_swapper import KVSwapper
from tandem.engine.hub import HubSource
from tandem.engine.loader import ModelInfo, load_model_info
from tandem.engine.model_runner import ModelRunner
from tandem.engine.outputs import RequestOutput, request_output, take_external_tokens
from tandem.engine.request import Request, RequestStatus, SamplingParams, SamplingParamsError
from tandem.engine.sampler import PendingSample, Sampler
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode.rejection_sampler import RejectionSampler, VerifyResult
from tandem.engine.spec_decode.speculator import Speculator
from tandem.engine.structured_output_manager import StructuredOutputManager
from tandem.engine.tp_workers import TPWorkers, check_tensor_parallel, exports_kv_cache
from tandem.kernels import compile_log

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "StepTimes"]

log = logging.getLogger(__name__)

# A step whose host time reaches this is logged (a decode step is 5-20 ms, a long
# prefill step a few hundred), at most once every SLOW_STEP_LOG_S.
SLOW_STEP_S = 0.5
SLOW_STEP_LOG_S = 10.0


@dataclass
class StepTimes:
    """Wall seconds of the last step's phases. On a GPU the model's kernels
    run asynchronously: `forward` is mostly launch time and `sample` waits for
    the GPU; schedule + prepare + update is the host's own work."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    propose: float = 0.0  # speculative decoding: the next step's draft tokens (a draft model's forwards)
    draft_tokens: int = 0  # speculative decoding: the draft tokens this step verified

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.update


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_prompt_tokens: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_computed: int
    prompt_tokens_local_hit: int
    prompt_tokens_external: int
    generation_tokens: int
    num_admissions_deferred: int = 0  # admission.py: a waiting request held back for KV headroom
    num_admissions_tail: int = 0  # admission.py: one admitted past the projection, in a short tail
    kv_save_bytes: int = 0
    kv_load_bytes: int = 0
    kv_save_blocks: int = 0
    kv_load_blocks: int = 0
    kv_save_seconds: float = 0.0
    kv_load_seconds: float = 0.0
    recompute_fallbacks: int = 0
    kv_write_wait_seconds: float = 0.0  # decode: waiting for a prefill's store writes to land
    kv_write_wait_timeouts: int = 0
    kv_save_blocks_lent: int = 0  # store connector: through the store's own slots, not the arena
    kv_load_blocks_lent: int = 0
    # Where KV transfers spend their time (connector.base.KV_PHASES): seconds and runs per phase.
    kv_phase_seconds: dict[str, float] = field(default_factory=dict)
    kv_phase_counts: dict[str, int] = field(default_factory=dict)
    num_held_blocks: int = 0  # direct transfer: blocks kept for a decode to copy
    # The host KV tier (--swap-space): preempted requests' blocks copied out and
    # back in, evicted prefix-cache blocks kept there, prompt blocks restored by hash.
    kv_swapped_out_blocks: int = 0
    kv_swapped_in_blocks: int = 0
    kv_host_offloaded_blocks: int = 0
    kv_host_hit_blocks: int = 0
    # Speculative decoding (SchedulerStats has their meaning): acceptance rate
    # is accepted / draft tokens, tokens per verifying step emitted / drafts.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0
    # The adaptive governor (spec_decode/governor.py): decode steps it let
    # speculate, steps it kept plain, and how often a batch size's choice flipped.
    spec_decode_governed_speculate_steps: int = 0
    spec_decode_governed_plain_steps: int = 0
    spec_decode_governor_changes: int = 0


@dataclass
class _InFlight:
    """A step whose sampled tokens have not reached the host yet."""

    requests: list[Request]  # its sampling requests, in row order
    pending: PendingSample


class LLMEngine:
    def __init__(self, config: EngineConfig, info: Optional[ModelInfo] = None,
                 kv_store: Optional[KVStore] = None,
                 kv_connector: Optional[Callable[[str, KVCacheLayout], KVConnector]] = None) -> None:
        """kv_store: where the "store" KV transfer keeps blocks (the service
        passes its KV store client; the engine owns and closes it).
        kv_connector: a connector of the caller's, made from (kv_role, the
        cache layout), instead of the one config.kv_transfer names."""
        self.config = config = config.with_defaults()
        mc = config.model
        self.info = info or load_model_info(mc.model, mc.load_format, mc.hf_config, mc.tokenizer,
                                            mc.max_model_len, HubSource(mc.revision, mc.download_dir))
        self.tokenizer = self.info.tokenizer
        self.model_id = self.info.model_id
        # Tensor parallelism: the other ranks start now and build their shards
        # beside this one's (engine/tp_workers.py).
        self.tp_workers: Optional[TPWorkers] = None
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(config, self.info.hf_config)
            self.tp_workers = TPWorkers(config)
        # A draft model's weights load before the target's cache is sized, and
        # every target block is sized with a draft block beside it.
        self.speculator: Optional[Speculator] = (Speculator.create(config, self.info)
                                                 if config.speculative is not None else None)
        self.runner = ModelRunner(config, self.info,
                                  self.speculator.kv_block_bytes if self.speculator is not None else 0)
        if self.tp_workers is not None:
            self.tp_workers.share_num_blocks(self.runner.num_blocks)
        layout = self.runner.layout
        # A connector moves whole blocks, every KV head, whatever the tensor
        # parallelism (engine/tp_kv.py): rank 0 holds a slice of the heads.
        connector_layout = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * config.tensor_parallel_size)
        self.connector = (kv_connector(config.kv_role, connector_layout) if kv_connector is not None
                          else self._make_connector(connector_layout, kv_store))
        self.runner.bind_kv_cache(self.connector.allocate_kv_cache() if self.connector else None)
        if self.tp_workers is not None and exports_kv_cache(config):
            # A decode copies a prompt's blocks out of every rank's cache: the handle names them all.
            self.connector.set_rank_exports(self.tp_workers.gather_exports(self.connector.export))
        if self.connector is not None:
            view = self.tp_workers.cache_view(self.runner.kv_cache) if self.tp_workers is not None else None
            self.connector.register_kv_cache(self.runner.kv_cache, view)
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size, config.cache.enable_prefix_caching,
                                 hash_extra=layout.model_key.encode())
        capacity = (layout.num_blocks - 1) * layout.block_size
        self.max_model_len = min(self.info.max_model_len, capacity)
        if self.max_model_len < self.info.max_model_len:
            log.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity,
                        self.info.max_model_len)
        if self.tp_workers is not None:
            self.tp_workers.share_max_model_len(self.max_model_len)
        self.runner.warm_up_kernels(self.max_model_len)
        self.runner.enable_cuda_graphs(self.max_model_len)
        self.sampler = Sampler(self.info.hf_config.vocab_size)
        self.rejection_sampler = RejectionSampler(self.sampler)
        if self.speculator is not None:
            self.speculator.bind(layout.num_blocks, self.max_model_len, config.cache.enable_prefix_caching)
        self.swapper: Optional[KVSwapper] = None
        if self.runner.num_host_slots:
            self.swapper = KVSwapper(HostKVTier(self.runner.num_host_slots), self.kv)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.connector, self.max_model_len,
                                   config.kv_hold_timeout_s, self.swapper)
        self.eos_token_id = self._eos_token_id()
        self.structured = StructuredOutputManager(self._grammar_backend, self.info.hf_config.vocab_size,
                                                  pin_memory=self.runner.device.type == "cuda")
        self.last_step_empty = False
        self.step_times = StepTimes()
        self._slow_step_logged = -SLOW_STEP_LOG_S
        # Outputs produced outside a model step (a decode's first tokens that
        # came from prefill), handed out by the next step().
        self._ready: list[RequestOutput] = []
        # Asynchronous scheduling: the step whose sampled tokens are still on
        # their way to the host (taken by the next step()); tensor-parallel
        # workers get them from rank 0's device (TPWorkers.run). Speculative
        # decoding proposes from each step's tokens on the host: with prompt
        # lookup, steps without drafts still go asynchronously, and a lookup one
        # token behind (_propose_next) says when to wait for the tokens and
        # propose; a draft model's proposals cannot be probed so, and its
        # engine steps in turn.
        self._inflight: Optional[_InFlight] = None
        self._propose_next = False
        self._unseen_freed: list[str] = []  # freed ids of plans that did not run (step)
        self.async_scheduling = (config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.runner.device.type == "cuda")) and \
            (self.speculator is None or self.speculator.can_probe)

    def _eos_token_id(self) -> Optional[int]:
        eos = getattr(self.info.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _grammar_backend(self):
        from tandem.engine.grammar import new_backend

        if self.tokenizer is None:
            raise RuntimeError("structured outputs need the model's tokenizer; this engine has none")
        stop = [self.eos_token_id] if self.eos_token_id is not None else []
        return new_backend(self.config.structured_outputs_backend, self.tokenizer,
                           self.info.hf_config.vocab_size, stop)

    def _make_connector(self, layout, kv_store: Optional[KVStore]) -> Optional[KVConnector]:
        kind, role = self.config.kv_transfer, self.config.kv_role
        if kind is None:
            return None
        if kind == "store":
            from tandem.engine.connector.kvstore import KVStoreConnector

            if kv_store is None:
                raise ValueError("kv_transfer 'store' needs a KV store: pass kv_store= (a "
                                 "tandem.services.kvstore.client.KVStoreClient, or any KVStore)")
            return KVStoreConnector(role, layout, kv_store, staging_bytes=self.config.kv_staging_bytes,
                                    slots_policy=self.config.kv_store_slots)
        if kind == "direct":
            from tandem.engine.connector.direct import DirectConnector

            return DirectConnector(role, layout)
        if kind == "nixl":
            from tandem.engine.connector.nixl import NixlConnector

            return NixlConnector(role, layout)
        raise ValueError(f"kv_transfer must be 'store', 'direct' or 'nixl' (or unset), got {kind!r}")

    # ---- requests ------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    first_token_ids: Optional[Sequence[int]] = None,
                    arrival_time: Optional[float] = None,
                    kv_transfer_params: Optional[dict] = None) -> Request:
        """Queue a request. first_token_ids: tokens already sampled elsewhere
        (the prefill service's first token): they go through this engine's
        detokenizer and stop rules as if sampled here, so the text and finish
        reason are exactly a colocated engine's; their output comes from the
        next step() without a model step, and generation continues after them.
        kv_transfer_params: where the connector finds the prompt's KV (the
        prefill's RequestOutput.kv_transfer_params)."""
        params.validate()  # a caller may have changed fields since construction
        if params.n != 1:
            raise SamplingParamsError("n: the engine takes n=1 per request; fan out n requests")
        vocab = self.info.hf_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise SamplingParamsError(f"prompt: token ids must be integers in [0, {vocab})")
        first = list(first_token_ids or [])
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in first):
            raise SamplingParamsError(f"first_token_ids: token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise SamplingParamsError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise SamplingParamsError("structured_outputs: this engine has no tokenizer to build "
                                      "the grammar with")
        self._check_min_tokens_leave_a_token(params, vocab)
        num_prompt = len(prompt_token_ids)
        if num_prompt + len(first) >= self.max_model_len:
            raise SamplingParamsError(
                f"prompt: {num_prompt} tokens leave no room to generate within the model's context "
                f"of {self.max_model_len} tokens")
        if params.max_tokens is None:
            params = copy.copy(params)
            params.max_tokens = self.max_model_len - num_prompt
        elif num_prompt + params.max_tokens > self.max_model_len:
            raise SamplingParamsError(
                f"max_tokens: prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {self.max_model_len} tokens")
        if request_id in self.scheduler.requests or request_id in self.structured:
            raise SamplingParamsError(f"request_id: {request_id!r} is already in use")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_id, arrival_time)
        if kv_transfer_params:
            request.kv_transfer_params.update(kv_transfer_params)
        if self.tokenizer is not None:
            request.detokenizer = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        if first:
            self._ready.append(take_external_tokens(request, first, self.max_model_len))
            if request.is_finished:
                return request
        if params.structured_outputs is not None:
            # Scheduled once its grammar is compiled (off this thread), with
            # the matcher advanced over the first tokens.
            self.structured.submit(request)
            return request
        self._admit(request)
        return request

    def _admit(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if self.connector is not None:
            _, num_local_hit_tokens = self.kv.get_computed_blocks(request)
            self.connector.prefetch(request, num_local_hit_tokens)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready go to the scheduler; those whose
        grammar failed finish with the error."""
        ready, failed = self.structured.take_ready()
        for request in ready:
            self._admit(request)
        outputs = []
        for request, error in failed:
            log.warning("request %s failed: %s", request.request_id, error)
            request.status = RequestStatus.FINISHED_ERROR
            out = request_output(request, [], "", [], RequestStatus.FINISHED_ERROR)
            out.error = error
            outputs.append(out)
        return outputs

    def _check_min_tokens_leave_a_token(self, params: SamplingParams, vocab: int) -> None:
        if params.min_tokens == 0 or len(params.stop_token_ids) < vocab - 1:
            return
        banned = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            banned.add(self.eos_token_id)
        if len(banned) >= vocab:
            raise SamplingParamsError(
                "min_tokens: while it holds, stop_token_ids and EOS ban every token of the vocabulary; "
                "leave at least one token allowed or set min_tokens to 0")

    def abort(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Stop requests now: their blocks go back before the next step, so a
        prompt's compute stops within the chunk that is running."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self._ready = [o for o in self._ready if o.request_id not in ids]
        for rid in ids:
            if self.structured.abort(rid) is not None:
                continue
            req = self.scheduler.abort(rid)
            if req is not None and self.speculator is not None:
                self.speculator.forget([rid])
            if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
                log.info("request %s aborted during its prefill, after %d of %d prompt tokens",
                         rid, req.num_computed_tokens, req.num_prompt_tokens)

    def release_kv(self, request_id: str) -> bool:
        """The consumer of a finished request's KV has it: let the blocks held
        for it go (False when none are held: released before, or expired)."""
        return self.scheduler.release_hold(request_id)

    def has_unfinished(self) -> bool:
        return (bool(self._ready) or self.scheduler.has_unfinished() or bool(self.structured.num_pending)
                or self._inflight is not None)

    # ---- one step ------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step (_step). Under tensor parallelism a worker lost during it
        fails it by name, its outputs unseen: its collectives were cut short."""
        workers = self.tp_workers
        if workers is None:
            return self._step()
        try:
            outputs = self._step()
        except Exception:
            workers.check(failed=True)  # a lost rank is the cause: said by name, this error chained
            raise
        workers.check()
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step. With asynchronous scheduling (_defers) a step's sampled
        tokens are left on the device: the next step is scheduled and queued
        first, reading them there, and only then are they taken (stop rules,
        text, outputs), so the host's work overlaps the device's. Its outputs
        then come from the next call."""
        ready, self._ready = self._ready, []
        if self.structured.num_pending:
            ready += self._admit_compiled()
        scheduler, connector, runner = self.scheduler, self.connector, self.runner
        inflight, self._inflight = self._inflight, None
        times, clock = self.step_times, time.perf_counter
        t0 = clock()
        compiles_before = compile_log.compiles()
        if self.speculator is not None:
            self.speculator.step_started(t0)
        if self._propose_next:
            # A lookup one token behind found drafts: this step waits for the
            # tokens in flight, so that its proposals follow the last of them.
            self._propose_next = False
            if inflight is not None:
                ready += self._take(inflight)
                self._forget_finished(inflight.requests)
                self.speculator.propose(inflight.requests)
                inflight = None
        if self.speculator is not None and self.speculator.drafts_pending:
            # Drafts proposed at the end of the step before: whether this step
            # also carries a prompt chunk is known only now, after the
            # arrivals, and such steps are measured apart (governor.py).
            self.speculator.drafts_pending = False
            if (scheduler.has_prompt_work()
                    and not self.speculator.keep_drafts_beside_prompt(scheduler.num_to_run())):
                scheduler.drop_drafts()
        plan = scheduler.schedule()
        if self.speculator is not None:
            self.speculator.forget(plan.freed_request_ids)  # preempted ones (the rest went already)
        t1 = clock()
        runner.swap(plan)  # even for an empty plan: a lone request may have been swapped out
        if plan.is_empty and (plan.swap_out or plan.swap_in) and self.tp_workers is not None:
            self.tp_workers.swap_only(plan)
        # e.g. every request waits on its KV fetch
        self.last_step_empty = plan.is_empty and not ready and inflight is None
        if plan.is_empty:
            # Only plans that run reach the runner and the tensor-parallel
            # workers: this one's freed ids go with the next, or a request that
            # preempted itself here would come back onto its old block list.
            self._unseen_freed += plan.freed_request_ids
            return ready + self._take(inflight) + scheduler.take_text()
        if self._unseen_freed:
            plan.freed_request_ids[:0] = self._unseen_freed
            self._unseen_freed = []
        before_layer = after_layer = None
        meta = plan.connector_meta
        if connector is not None and (meta.loads or meta.saves):
            if meta.loads:
                failed = connector.start_load(meta)
                if failed:  # slower, never wrong: compute what could not be loaded
                    scheduler.rollback_external(plan, failed)
                before_layer = connector.wait_for_layer_load
            if meta.saves:
                after_layer = lambda layer: connector.save_layer(layer, meta)  # noqa: E731
                if self.tp_workers is not None:  # the other ranks' heads of the saved blocks first
                    after_layer = self.tp_workers.gathering(after_layer, meta.saved_block_ids())
        t1_loaded = clock()  # the host tier's copies and the connector's loads count in no phase
        pending_tokens = inflight.pending.tokens if inflight is not None else None
        if self.tp_workers is not None:
            self.tp_workers.run(plan, pending_tokens)
        batch = runner.prepare(plan, pending_tokens)
        t2 = clock()
        logits = runner.forward(batch, plan, before_layer, after_layer)
        if after_layer is not None:
            connector.wait_for_save()
        t3 = clock()
        # The text of the verifying step before, while this one runs.
        outputs = ready + scheduler.take_text()
        requests = scheduler.sampling_requests
        num_accepted = 0
        if logits is not None and plan.num_draft_tokens:
            result = self._verify(logits, requests, scheduler.sampling_drafts)
            num_accepted = sum(result.num_accepted)
            t4 = clock()
            outputs += self._take(inflight)  # the step before's tokens come first
            # Under asynchronous scheduling the text waits for the next step's
            # launch (Scheduler.take_text), as a plain step's tokens do.
            outputs += scheduler.update_verified(result.token_ids, result.logprobs, result.num_accepted,
                                                 result.errors, defer_text=self.async_scheduling)
        elif logits is not None and self._defers(requests):
            pending = self.sampler.launch(logits, requests)
            t4 = clock()
            # The step before's tokens, while this one runs; this one's next time.
            outputs += self._take(inflight)
            for row, request in enumerate(requests):
                request.pending_token_row = row
            self._inflight = _InFlight(requests, pending)
        elif logits is not None:
            structured = self.structured
            masks = structured.bitmask(requests) if structured.in_use else None
            result = self.sampler(logits, requests, masks)
            if masks is not None:
                structured.accept(requests, result.token_ids, result.errors)
            t4 = clock()
            outputs += self._take(inflight)  # the step before's tokens come first
            outputs += scheduler.update(result.token_ids, result.logprobs, result.errors, requests)
        else:
            t4 = t3
            outputs += self._take(inflight)
        t5 = clock()
        if self.speculator is not None and logits is not None:
            self._forget_finished(requests)
            self.speculator.step_ran(t0, plan, num_accepted)
            # Unless the next step is to decode plainly (no lookup, no draft forwards).
            # Decided for the batch of the step that ran: a finished request's
            # place is taken by a newcomer only after this (a server's
            # arrivals, the bench's replacements), so the survivors' count
            # would put the step beside its prompt chunk in the next smaller
            # group, whose leader learned from other steps.
            if self.speculator.decide(max(len(scheduler.running), len(requests))):
                if self._inflight is None:
                    self.speculator.propose(requests)  # those still running
                else:  # this step's tokens are in flight: look up without them (see _step's start)
                    self._propose_next = self.speculator.would_propose(requests)
            elif self.speculator.wants_shadow():
                self.speculator.shadow(requests)  # for the governor: would speculating pay now?
        t6 = clock()
        times.schedule, times.prepare, times.forward = t1 - t0, t2 - t1_loaded, t3 - t2
        times.sample, times.update, times.propose = t4 - t3, t5 - t4, t6 - t5
        times.draft_tokens = sum(plan.num_draft_tokens) if plan.num_draft_tokens else 0
        if t6 - t0 >= SLOW_STEP_S:
            self._log_slow_step(t6 - t0, t1_loaded - t1, times, plan, compiles_before)
        return outputs

    def _forget_finished(self, requests: list[Request]) -> None:
        """Finished requests' draft state goes now, not with the next plan's
        freed ids: an idle engine holds no draft blocks."""
        self.speculator.forget([r.request_id for r in requests if r.is_finished])

    def _log_slow_step(self, seconds: float, loading: float, times, plan: SchedulerOutput,
                       compiles_before: int) -> None:
        """One line per slow step (at most every SLOW_STEP_LOG_S): where its host
        time went, and the Triton kernels it waited to compile, if any."""
        now = time.monotonic()
        if now - self._slow_step_logged < SLOW_STEP_LOG_S:
            return
        self._slow_step_logged = now
        compiled = compile_log.recent(compiles_before)
        log.warning("a step took %.0f ms (%d entries): schedule %.1f, swaps and KV loads %.1f, prepare %.1f, "
                    "forward %.1f, sample %.1f, update %.1f ms%s", seconds * 1e3, plan.num_entries,
                    times.schedule * 1e3, loading * 1e3, times.prepare * 1e3, times.forward * 1e3,
                    times.sample * 1e3, times.update * 1e3,
                    f"; compiled Triton kernels {', '.join(compiled)}" if compiled else "")

    def _defers(self, requests: list[Request]) -> bool:
        """Whether this step's tokens may stay on the device while the next
        step is scheduled: asynchronous scheduling is on, and no request's
        next sampling needs this token on the host (a grammar's mask,
        penalties over its history, min_tokens still counting)."""
        if not self.async_scheduling:
            return False
        for r in requests:
            p = r.params
            if (p.structured_outputs is not None or p.repetition_penalty != 1.0
                    or p.presence_penalty or p.frequency_penalty or r.num_output_tokens < p.min_tokens):
                return False
        return True

    def _take(self, inflight: Optional["_InFlight"]) -> list[RequestOutput]:
        """The tokens of a step left in flight, once on the host: the update step."""
        if inflight is None:
            return []
        result = inflight.pending.result()
        return self.scheduler.update(result.token_ids, result.logprobs, result.errors, inflight.requests)

    def _verify(self, logits, requests: list[Request], drafts: list[list[int]]) -> VerifyResult:
        """Sample a step whose plan carries draft tokens: requests with drafts
        through the rejection sampler, the others (one row each, grammars
        among them) through the sampler as in any step."""
        counts = [1 + len(d) for d in drafts]
        last_rows, row = [], -1
        for n in counts:
            row += n
            last_rows.append(row)
        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        result = VerifyResult()
        per_request: dict[int, tuple[list[int], list, int]] = {}
        if plain:
            plain_requests = [requests[i] for i in plain]
            structured = self.structured
            masks = structured.bitmask(plain_requests) if structured.in_use else None
            sampled = self.sampler(logits[[last_rows[i] for i in plain]], plain_requests, masks)
            if masks is not None:
                structured.accept(plain_requests, sampled.token_ids, sampled.errors)
            for j, i in enumerate(plain):
                per_request[i] = ([sampled.token_ids[j]], [sampled.logprobs[j]], 0)
                if j in sampled.errors:
                    result.errors[i] = sampled.errors[j]
        if spec:
            rows = [r for i in spec for r in range(last_rows[i] - counts[i] + 1, last_rows[i] + 1)]
            spec_logits = logits if len(rows) == len(logits) else logits[rows]  # all rows, in order: no gather
            verified = self.rejection_sampler(spec_logits, [requests[i] for i in spec], [drafts[i] for i in spec])
            for j, i in enumerate(spec):
                per_request[i] = (verified.token_ids[j], verified.logprobs[j], verified.num_accepted[j])
                if j in verified.errors:
                    result.errors[i] = verified.errors[j]
        for i in range(len(requests)):
            result.add(*per_request[i])
        return result

    def stats(self) -> EngineStats:
        sched = self.scheduler
        waiting = list(sched.waiting_requests()) + self.structured.pending_requests()
        cs = self.connector.stats if self.connector is not None else None
        ss = sched.stats
        stats = EngineStats(
            num_running=len(sched.running), num_waiting=len(waiting),
            num_waiting_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            kv_cache_usage=self.kv.usage, num_free_blocks=self.kv.pool.num_free_blocks,
            num_total_blocks=self.kv.pool.num_usable_blocks,
            prefix_cache_queries=ss.prefix_cache_queries, prefix_cache_hits=ss.prefix_cache_hits,
            num_preemptions=ss.num_preemptions, num_admissions_deferred=ss.num_admissions_deferred,
            num_admissions_tail=ss.num_admissions_tail,
            prompt_tokens_computed=ss.prompt_tokens_computed,
            prompt_tokens_local_hit=ss.prompt_tokens_local_hit,
            prompt_tokens_external=ss.prompt_tokens_external, generation_tokens=ss.generation_tokens,
            kv_save_bytes=cs.save_bytes if cs else 0, kv_load_bytes=cs.load_bytes if cs else 0,
            kv_save_blocks=cs.save_blocks if cs else 0, kv_load_blocks=cs.load_blocks if cs else 0,
            kv_save_seconds=cs.save_seconds if cs else 0.0, kv_load_seconds=cs.load_seconds if cs else 0.0,
            # A failed lookup (store down) and a failed load both mean the prefix
            # is computed here instead of loaded: both are recompute fallbacks.
            recompute_fallbacks=(cs.load_failures + cs.lookup_failures) if cs else 0,
            kv_write_wait_seconds=cs.write_wait_seconds if cs else 0.0,
            kv_write_wait_timeouts=cs.write_wait_timeouts if cs else 0,
            kv_save_blocks_lent=cs.save_blocks_lent if cs else 0,
            kv_load_blocks_lent=cs.load_blocks_lent if cs else 0,
            num_held_blocks=sched.num_held_blocks,
            spec_decode_num_drafts=ss.spec_num_drafts, spec_decode_num_draft_tokens=ss.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=ss.spec_num_accepted_tokens,
            spec_decode_num_emitted_tokens=ss.spec_num_emitted_tokens)
        if cs is not None:
            stats.kv_phase_seconds, stats.kv_phase_counts = cs.phases()
        governor = self.speculator.governor if self.speculator is not None else None
        if governor is not None:
            gc = governor.counts
            stats.spec_decode_governed_speculate_steps = gc.speculate_steps
            stats.spec_decode_governed_plain_steps = gc.plain_steps
            stats.spec_decode_governor_changes = gc.leader_changes
        if self.swapper is not None:
            sw = self.swapper.stats
            stats.kv_swapped_out_blocks, stats.kv_swapped_in_blocks = sw.swapped_out_blocks, sw.swapped_in_blocks
            stats.kv_host_offloaded_blocks, stats.kv_host_hit_blocks = sw.offloaded_blocks, sw.host_hit_blocks
        return stats

    def shutdown(self) -> None:
        if self.tp_workers is not None:
            self.runner.release_cuda_graphs()  # before the group is destroyed
            self.tp_workers.stop()
            self.tp_workers = None
        self.structured.close()
        if self.connector is not None:
            self.connector.close()
