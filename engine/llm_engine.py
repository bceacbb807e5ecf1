"""The engine: add_request / step / abort, and the offline `LLM.generate`.

One step = schedule -> (load KV) -> run the model -> (save KV) -> sample ->
apply stop rules -> emit outputs. All of it runs on one thread; the asyncio
wrapper for services lives in async_engine.py.
"""
from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

from tandem.engine.config import EngineConfig
from tandem.engine.connector.base import KVStore
from tandem.engine.detokenizer import Detokenizer
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.loader import ModelInfo, load_model_info
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import (Request, RequestFailedError, RequestStatus, SamplingParams,
                                   SamplingParamsError, TokenLogprob)
from tandem.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), plus running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    block_hashes: list[str] = field(default_factory=list)
    stop_reason: Optional[Union[str, int]] = None
    # Set on a finished request by the connector: e.g. a DirectHandle to the
    # prompt's blocks, which the decode engine copies (connector/direct.py).
    kv_transfer_params: dict = field(default_factory=dict)
    # finish_reason "error": why the engine failed this request (and only it).
    error: Optional[RequestFailedError] = None


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
    kv_save_bytes: int = 0
    kv_load_bytes: int = 0
    kv_save_blocks: int = 0
    kv_load_blocks: int = 0
    kv_save_seconds: float = 0.0
    kv_load_seconds: float = 0.0
    recompute_fallbacks: int = 0
    num_held_blocks: int = 0  # direct transfer: blocks kept for a decode to copy


class LLMEngine:
    def __init__(self, config: EngineConfig, info: Optional[ModelInfo] = None,
                 kv_store: Optional[KVStore] = None) -> None:
        """kv_store: where the "store" KV transfer keeps blocks (the service
        passes its KV store client; the engine owns and closes it)."""
        self.config = config = config.with_defaults()
        mc = config.model
        self.info = info or load_model_info(mc.model, mc.load_format, mc.hf_config, mc.tokenizer,
                                            mc.max_model_len)
        self.tokenizer = self.info.tokenizer
        self.model_id = self.info.model_id
        self.runner = ModelRunner(config, self.info)
        block_size = config.cache.block_size
        # The model id and dtype name the blocks: KV of another model or
        # precision never matches, in this process or in a shared store.
        self.hash_extra = f"{self.model_id}|{self.runner.dtype}".encode()
        self.kv = KVCacheManager(self.runner.num_blocks, block_size,
                                 config.cache.enable_prefix_caching, self.hash_extra)
        capacity = (self.runner.num_blocks - 1) * block_size
        self.max_model_len = min(self.info.max_model_len, capacity)
        if self.max_model_len < self.info.max_model_len:
            log.warning("KV cache holds %d tokens: max_model_len lowered from %d", capacity,
                        self.info.max_model_len)
        self.runner.enable_cuda_graphs(self.max_model_len)
        self.connector = self._make_connector(kv_store)
        self.last_step_empty = False
        self.scheduler = Scheduler(config.scheduler, config.cache, self.kv, self.connector)
        self.eos_token_id = self._eos_token_id()
        self._detok: dict[str, Detokenizer] = {}
        self._pending_first: dict[str, bool] = {}
        # Outputs produced outside a model step (a decode's first tokens that
        # came from prefill), handed out by the next step().
        self._ready: list[RequestOutput] = []
        self._prompt_computed = 0
        self._prompt_local_hit = 0
        self._prompt_external = 0
        self._generation_tokens = 0
        self._ids = itertools.count()

    def _eos_token_id(self) -> Optional[int]:
        eos = getattr(self.info.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _make_connector(self, kv_store: Optional[KVStore]):
        kind = self.config.kv_transfer
        if kind is None:
            return None
        if kind == "store":
            from tandem.engine.connector.kvstore import KVStoreConnector

            if kv_store is None:
                raise ValueError("kv_transfer 'store' needs a KV store: pass kv_store= (a "
                                 "tandem.services.kvstore.client.KVStoreClient, or any KVStore)")
            return KVStoreConnector(self.config, self.kv, self.runner, kv_store)
        if kind == "direct":
            from tandem.engine.connector.direct import DirectConnector

            return DirectConnector(self.config, self.kv, self.runner, self.config.kv_hold_timeout_s)
        raise ValueError(f"kv_transfer must be 'store' or 'direct' (or unset), got {kind!r}")

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
        if request_id in self.scheduler.requests or request_id in self._detok:
            raise SamplingParamsError(f"request_id: {request_id!r} is already in use")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_id, arrival_time)
        if kv_transfer_params:
            request.kv_transfer_params.update(kv_transfer_params)
        self._detok[request_id] = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self._pending_first[request_id] = True
        if first:
            now, text = time.monotonic(), ""
            for token in first:
                out = self._append_and_check(request, token, None, now, scheduled=False)
                text += out.new_text
                if out.finished:
                    break
            out.new_token_ids, out.new_text = first[: out.num_output_tokens], text
            self._ready.append(out)
            if out.finished:
                return request
        self.scheduler.add_request(request)
        if self.connector is not None:
            self.connector.prefetch(request)
        return request

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
            req = self.scheduler.abort(rid)
            if req is not None:
                self._forget(rid)
                if req.num_computed_tokens < req.num_prompt_tokens:
                    log.info("request %s aborted during its prefill, after %d of %d prompt tokens",
                             rid, req.num_computed_tokens, req.num_prompt_tokens)

    def release_kv(self, request_id: str) -> bool:
        """The consumer of a finished request's KV has it: the connector may
        let the blocks go (a no-op for connectors that keep nothing)."""
        release = getattr(self.connector, "release", None)
        return bool(release(request_id)) if release is not None else False

    def has_unfinished(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished()

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._pending_first.pop(request_id, None)
        self.runner.sampler.forget(request_id)

    # ---- one step ------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        plan = self.scheduler.schedule()
        self.last_step_empty = plan.is_empty and not ready  # e.g. every request waits on its KV fetch
        if plan.is_empty:
            return ready
        meta = plan.connector_meta
        if self.connector is not None and meta is not None:
            failed = self.connector.start_load(meta, self.runner.kv_caches)
            for s in plan.scheduled:
                if s.request.request_id in failed:
                    # Slower, never wrong: compute what could not be loaded.
                    self.scheduler.rollback_external(s, s.request.num_external_tokens)
        for s in plan.scheduled:
            self._count_prompt_tokens(s)
        after_layer = None
        if self.connector is not None and meta is not None and meta.saves:
            after_layer = lambda layer: self.connector.save_layer(layer, self.runner.kv_caches, meta)  # noqa: E731
        sampled, result = self.runner.execute(plan, after_layer)
        if after_layer is not None:
            self.connector.wait_for_save()
        now = time.monotonic()
        outputs = ready
        for i, (s, token, logprob) in enumerate(zip(sampled, result.token_ids, result.logprobs)):
            error = result.errors.get(i)
            if error is None:
                try:
                    outputs.append(self._append_and_check(s.request, token, logprob, now))
                    continue
                except Exception as exc:  # detokenizing or a stop rule broke on this request alone
                    log.exception("request %s failed after sampling", s.request.request_id)
                    error = RequestFailedError(f"the engine failed this request: {exc!r}",
                                               caused_by_request=False)
            outputs.append(self._fail(s.request, error))
        return outputs

    def _fail(self, req: Request, error: RequestFailedError) -> RequestOutput:
        """Finish one request with an error; its blocks go back, the engine steps on."""
        log.warning("request %s failed: %s", req.request_id, error)
        if not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self._forget(req.request_id)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[], new_text="", new_logprobs=[], finished=True,
            finish_reason=RequestStatus.FINISHED_ERROR.value, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
            num_external_tokens=req.num_external_tokens, error=error)

    def _count_prompt_tokens(self, s) -> None:
        req = s.request
        if self._pending_first.get(req.request_id) and s.start == req.num_cached_tokens + req.num_external_tokens:
            self._prompt_local_hit += req.num_cached_tokens
            self._prompt_external += req.num_external_tokens
        prompt_end = req.num_prompt_tokens
        computed_prompt = max(0, min(s.start + s.num_new_tokens, prompt_end) - s.start)
        if req.num_preemptions == 0:
            self._prompt_computed += computed_prompt

    def _append_and_check(self, req: Request, token: int, logprob: Optional[TokenLogprob],
                          now: float, scheduled: bool = True) -> RequestOutput:
        """Take one sampled token: stop rules, text delta, the output.
        scheduled=False: a token sampled elsewhere, for a request not (yet) in
        the scheduler; a stop then only marks it finished."""
        req.append_token(token, logprob)
        if scheduled:  # a token sampled elsewhere counts as generated there
            self._generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        params = req.params
        detok = self._detok[req.request_id]
        status = None
        if (token == req.eos_token_id and not params.ignore_eos
                and req.num_output_tokens > params.min_tokens):
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens > params.min_tokens and token in req.stop_token_set:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        stop_str = detok.add([token])
        if status is None and stop_str is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (req.num_output_tokens >= params.max_tokens
                               or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            # The bytes of an unfinished character join the text now; a stop
            # string they complete outranks the length limit, as it would
            # have had they been decoded with the rest.
            stop_str = detok.finish()
            if stop_str is not None and status is RequestStatus.FINISHED_LENGTH:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        # A request's first step reports its prompt's block hashes (prefill's reply).
        first = self._pending_first.pop(req.request_id, False) if scheduled else False
        hashes = [h.hex() for h in self.kv.block_hashes(req)[: req.num_prompt_tokens // self.kv.block_size]] if first else []
        finished = status is not None
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=[token], new_text=detok.delta(finished),
            new_logprobs=[logprob] if logprob is not None else [], finished=finished,
            finish_reason=status.value if finished else None, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
            num_external_tokens=req.num_external_tokens, block_hashes=hashes,
            stop_reason=req.stop_reason)
        if finished:
            if scheduled:
                self.scheduler.finish(req, status)
            else:
                req.status = status
            self._forget(req.request_id)
            out.kv_transfer_params = req.kv_transfer_params
        return out

    def stats(self) -> EngineStats:
        sched = self.scheduler
        waiting = list(sched.waiting_requests())
        cs = self.connector.stats if self.connector is not None else None
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(waiting),
            num_waiting_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            kv_cache_usage=self.kv.usage, num_free_blocks=self.kv.pool.num_free_blocks,
            num_total_blocks=self.kv.pool.num_usable_blocks,
            prefix_cache_queries=sched.stats.prefix_cache_queries,
            prefix_cache_hits=sched.stats.prefix_cache_hits,
            num_preemptions=sched.stats.num_preemptions,
            prompt_tokens_computed=self._prompt_computed,
            prompt_tokens_local_hit=self._prompt_local_hit,
            prompt_tokens_external=self._prompt_external,
            generation_tokens=self._generation_tokens,
            kv_save_bytes=cs.save_bytes if cs else 0, kv_load_bytes=cs.load_bytes if cs else 0,
            kv_save_blocks=cs.save_blocks if cs else 0, kv_load_blocks=cs.load_blocks if cs else 0,
            kv_save_seconds=cs.save_seconds if cs else 0.0, kv_load_seconds=cs.load_seconds if cs else 0.0,
            # A failed lookup (store down) and a failed load both mean the prefix
            # is computed here instead of loaded: both are recompute fallbacks.
            recompute_fallbacks=(cs.load_failures + cs.lookup_failures) if cs else 0,
            num_held_blocks=getattr(self.connector, "num_held_blocks", 0))

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"
