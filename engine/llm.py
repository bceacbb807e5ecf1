"""Offline use: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator, Optional, Sequence, Union

from tandem.engine.beam_search import Beam, BeamSearch, BeamSearchParams, BeamSearchParamsError
from tandem.engine.config import DEFAULT_MODEL, EngineArgs
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import SamplingParams, TokenLogprob

Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: Optional[str]
    stop_reason: Any = None


@dataclass
class GenerateOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[Beam]  # the finished hypotheses, best first (beam_width of them)


def engine_args(model: str, **kwargs: Any) -> EngineArgs:
    """EngineArgs from keyword arguments named as its fields (block_size=...,
    max_num_batched_tokens=..., dtype=...); an unknown name is a TypeError."""
    known = {f.name for f in fields(EngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; the options are "
                        f"EngineArgs' fields: {', '.join(sorted(known - {'model'}))}")
    return EngineArgs(model=model, **kwargs)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, kv_store: Any = None, **kwargs: Any) -> None:
        """kwargs: engine options by their EngineArgs field names (the flags'
        names with underscores); kv_store: the KVStore of kv_transfer="store".
        A bad value raises ConfigError (a ValueError) naming its flag."""
        self._start(engine_args(model, **kwargs), kv_store)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, kv_store: Any = None) -> "LLM":
        """An LLM from settings a command parsed (EngineArgs.from_cli_args)."""
        llm = cls.__new__(cls)
        llm._start(args, kv_store)
        return llm

    def _start(self, args: EngineArgs, kv_store: Any) -> None:
        # The caller passes the KVStore object itself: no address needed.
        config = replace(args.create_engine_config(kv_store_injected=True), offline=True)
        self.engine = LLMEngine(config, kv_store=kv_store)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's helpers: tensor-parallel ranks, connector, grammar
        compiler. (At exit they stop anyway; a process that builds another
        tensor-parallel LLM must shut the first down: one group per process.)"""
        self.engine.shutdown()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(self, messages: list[dict[str, str]], params: Optional[SamplingParams] = None) -> GenerateOutput:
        return self.generate([self.chat_prompt(messages)], params)[0]

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[GenerateOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = (list(params) if isinstance(params, (list, tuple))
                       else [params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: list[GenerateOutput] = []
        children: dict[str, tuple[GenerateOutput, CompletionOutput]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            ids = self.encode(prompt)
            result = GenerateOutput(request_id=str(i), prompt_token_ids=ids)
            results.append(result)
            # Parallel sampling: n requests over one prompt. The prefix cache
            # shares the prompt's blocks among them.
            for j, child in enumerate(p.choices()):
                rid = f"{i}#{j}"
                completion = CompletionOutput(index=j, text="", token_ids=[], logprobs=[], finish_reason=None)
                result.outputs.append(completion)
                children[rid] = (result, completion)
                self.engine.add_request(rid, ids, child)
        for out in self._drain(list(children)):
            result, completion = children[out.request_id]
            completion.token_ids.extend(out.new_token_ids)
            completion.text += out.new_text
            completion.logprobs.extend(out.new_logprobs)
            if out.finished:
                completion.finish_reason = out.finish_reason
                completion.stop_reason = out.stop_reason
                result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
        return results

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (engine/beam_search.py): each step scores every live
        beam of every prompt in one engine run, one single-token request per
        beam; the prefix cache shares the beams' common KV blocks."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params.validate()
        ids = [self.encode(p) for p in prompts]
        for i, p in enumerate(ids):
            if len(p) + params.max_tokens > self.engine.max_model_len:
                raise BeamSearchParamsError(
                    f"max_tokens: prompt {i} ({len(p)} tokens) + max_tokens ({params.max_tokens}) "
                    f"exceeds the model's context of {self.engine.max_model_len} tokens")
        searches = [BeamSearch(params, self.engine.eos_token_id) for _ in ids]
        # ignore_eos: with max_tokens=1 it changes nothing but keeps min_tokens
        # rules out of the way; the search itself decides what EOS means.
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=params.num_logprobs, ignore_eos=True)
        round_ = 0
        while not all(s.done for s in searches):
            wanted: dict[str, dict[int, float]] = {}
            for i, s in enumerate(searches):
                for b, beam in enumerate(s.live if not s.done else ()):
                    rid = f"beam{round_}-{i}-{b}"
                    wanted[rid] = {}
                    self.engine.add_request(rid, ids[i] + beam.token_ids, step)
            for out in self._drain(list(wanted)):
                if out.new_logprobs:
                    wanted[out.request_id] = out.new_logprobs[0].top
            for i, s in enumerate(searches):
                if not s.done:
                    s.advance([wanted[f"beam{round_}-{i}-{b}"] for b in range(len(s.live))])
            round_ += 1
        results = []
        for p, s in zip(ids, searches):
            for beam in s.finished:
                beam.text = self.tokenizer.decode(beam.token_ids, skip_special_tokens=True)
            results.append(BeamSearchOutput(p, s.best()))
        return results

    def _drain(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Step the engine until it has nothing left, yielding every output. A
        failed request raises its error after aborting `request_ids`, so that
        nothing half-done stays behind in the engine for the next call."""
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error is not None:
                    self.engine.abort(request_ids)
                    raise out.error
                yield out
