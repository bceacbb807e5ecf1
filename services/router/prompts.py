"""Prompts: what a client sent, turned into token ids (the chat template
applied, then tokenized) and checked against the vocabulary, the context and
the most choices one request may ask for. The context limit travels with
each job: it is what the engines report now (engine_reports.py), which
changes as instances come and go.

This is the router's CPU-heavy work, and it grows with the body: for a 4 MiB
body of 90k chat messages, parsing takes 0.4 s, the chat template (pure
Python jinja) 0.5 s, tokenizing 2-3 s. On the event loop that froze every
other stream for as long, so it runs in a PromptPool of worker processes.
Processes, not threads: the parser, the template and the tokenizer all hold
the GIL, pydantic for the whole 0.4 s parse. Measured on a 2-core `tandem up
--prefill 2 --decode 2`, the longest gap of another stream (one chunk per
token, 50 ms median) while a 90k-message body was prepared: 2.5-3.0 s on the
event loop, 340-520 ms in a thread, 60-110 ms in a worker process (the
stream alone: 55-65 ms). A worker gets the raw body and sends back the
parsed request without its bulk (messages, prompts) plus the token ids, so
the loop copies bytes and never walks the body.

Errors are InvalidRequest with an OpenAI-style `param`; the APIs turn them
into HTTP 400/404/408/413 or gRPC INVALID_ARGUMENT/NOT_FOUND.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import signal
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import grpc
import pydantic

from tandem.services.router.dispatch import DispatchError
from tandem.services.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                    validation_message)
from tandem.v1 import generate_pb2

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class InvalidRequest(Exception):
    """A request the client must change; raised in worker processes too."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def __reduce__(self):
        # Exceptions pickle only their args by default; a worker's must keep param and status.
        return InvalidRequest, (self.message, self.param, self.status, self.code)


@dataclass
class Prepared:
    """A parsed HTTP request with its bulk (messages or prompts) replaced by
    the token ids: one prompt for a chat, one or more for completions."""

    body: Any  # ChatCompletionRequest or CompletionRequest, messages / prompt emptied
    prompts: list[list[int]]


class Prompter:
    """Body -> token ids. Pure and synchronous: it runs in the pool's workers.
    Each whole-request method gets the context limit of its job."""

    def __init__(self, tokenizer: Any, max_choices: int) -> None:
        self.tokenizer = tokenizer
        self.max_choices = max_choices
        self.vocab_size = len(tokenizer)

    # --- whole requests ---------------------------------------------------------------

    def chat_completion(self, raw: bytes, max_model_len: int) -> Prepared:
        body = _parse(raw, ChatCompletionRequest)
        self._check_choices(1, body.n)
        ids = self.chat([{"role": m.role, "content": m.text()} for m in body.messages])
        return Prepared(body.model_copy(update={"messages": []}),
                        [_fits(ids, "messages", max_model_len)])

    def completion(self, raw: bytes, max_model_len: int) -> Prepared:
        body = _parse(raw, CompletionRequest)
        p = body.prompt
        if not p:
            raise InvalidRequest("prompt: must not be empty", param="prompt")
        many = not isinstance(p, str) and not isinstance(p[0], int)
        # Before tokenizing: a request for 20k prompts is refused in microseconds.
        self._check_choices(len(p) if many else 1, body.n)
        if isinstance(p, str):
            prompts = [_fits(self.text(p), "prompt", max_model_len)]
        elif isinstance(p[0], int):
            prompts = [_fits(self.token_ids(p), "prompt", max_model_len)]
        elif isinstance(p[0], str):
            prompts = [_fits(self.text(s, param=f"prompt[{i}]"), "prompt", max_model_len)
                       for i, s in enumerate(p)]
        else:
            prompts = [_fits(self.token_ids(ids, param=f"prompt[{i}]"), "prompt", max_model_len)
                       for i, ids in enumerate(p)]
        return Prepared(body.model_copy(update={"prompt": []}), prompts)

    def generate(self, raw: bytes, max_model_len: int) -> list[int]:
        """The prompt of a serialized tandem.v1.GenerateRequest (the public gRPC API)."""
        request = generate_pb2.GenerateRequest.FromString(raw)
        self._check_choices(1, request.params.n or 1)
        which = request.WhichOneof("input")
        if which == "prompt":
            return _fits(self.text(request.prompt), "prompt", max_model_len)
        if which == "token_ids":
            return _fits(self.token_ids(request.token_ids.ids, param="token_ids"), "token_ids",
                         max_model_len)
        if which == "chat":
            ids = self.chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
            return _fits(ids, "messages", max_model_len)
        raise InvalidRequest("input: set one of prompt, token_ids or chat", param="input")

    # --- prompts ------------------------------------------------------------------------

    def chat(self, messages: Sequence[dict]) -> list[int]:
        """messages: [{"role": ..., "content": str}] -> the templated prompt's token ids."""
        if not messages:
            raise InvalidRequest("messages: must contain at least one message", param="messages")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role: {m.get('role')!r} is not one of "
                                     f"{', '.join(CHAT_ROLES)}", param=f"messages[{i}].role")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content: must be a string",
                                     param=f"messages[{i}].content")
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise on role orders they do not support
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}",
                                 param="messages") from None
        # The template already wrote the special tokens it wants.
        return self.text(text, param="messages", add_special_tokens=False)

    def text(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequest(f"{param}: must not be empty", param=param)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidRequest(f"{param}: tokenizes to no tokens", param=param)
        return list(ids)

    def token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise InvalidRequest(f"{param}: must contain at least one token", param=param)
        for t in ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequest(f"{param}: token id {t} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", param=param)
        return list(ids)

    def _check_choices(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_choices:
            param = "prompt" if prompts > 1 else "n"
            raise InvalidRequest(
                f"{param}: {prompts} prompt(s) x n={n} ask for {prompts * n} completions; this "
                f"router takes at most {self.max_choices} in one request "
                "(--max-choices-per-request): split the request", param=param)


def _fits(ids: list[int], param: str, max_model_len: int) -> list[int]:
    # Checked here, not only by the frontend, so that a prompt far over the
    # context never travels back to the event loop as a million ids.
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens and the prompt "
            f"has {len(ids)}; shorten the prompt.", param=param, code="context_length_exceeded")
    return ids


def _parse(raw: bytes, kind: type[pydantic.BaseModel]) -> Any:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("The body is not valid UTF-8.") from None
    try:
        return kind.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        message, param = validation_message(exc)
        raise InvalidRequest(message, param=param) from None


# --- the pool -------------------------------------------------------------------------

_worker: Optional[Prompter] = None  # the Prompter of this worker process
WORKER_NICENESS = 10


def _init_worker(tokenizer_blob: bytes, max_choices: int) -> None:
    global _worker
    # Ctrl+C reaches the whole process group; the router stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    # Below the event loop: where CPUs are short, streams under way go first and
    # a huge body waits for its tokens (it is refused or served later anyway).
    os.nice(WORKER_NICENESS)
    _worker = Prompter(pickle.loads(tokenizer_blob), max_choices)


def _run(method: str, arg: Any, max_model_len: int) -> Any:
    return getattr(_worker, method)(arg, max_model_len)


def _die_with_parent() -> None:
    """A worker gets SIGTERM when the router dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the executor's own shutdown still stops them
        pass


class PromptPool:
    """A bounded pool of worker processes running a Prompter.

    At most `workers + queue` jobs are outstanding (running or waiting); one
    more is refused at once with a RESOURCE_EXHAUSTED DispatchError (HTTP 429
    with Retry-After) rather than waiting behind a queue of huge bodies. A job
    counts until its worker finishes it, even when its client has gone: the
    worker is busy either way.

    Each job carries the context limit its prompts must fit; `max_model_len`
    here is only the limit of jobs submitted without one (a pool used on its
    own). The router's Frontend gives every job the engines' current limit.
    """

    def __init__(self, tokenizer: Any, max_model_len: Optional[int] = None, max_choices: int = 256,
                 workers: int = 2, queue: int = 256) -> None:
        if workers < 1:
            raise ValueError("a PromptPool needs at least one worker")
        self.max_model_len = max_model_len
        self._initargs = (pickle.dumps(tokenizer), max_choices)
        self.workers = workers
        self.queue = queue
        self.outstanding = 0
        self._executor = self._start()

    def _start(self, warm: bool = True) -> concurrent.futures.ProcessPoolExecutor:
        # spawn, not fork: the router has gRPC and uvicorn threads by now.
        executor = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=self._initargs)
        if warm:
            # Start every worker now, from this thread: a job must not wait for
            # a worker to import transformers (seconds), and a worker's
            # parent-death signal follows the thread that started it.
            concurrent.futures.wait([executor.submit(os.getpid) for _ in range(self.workers)])
        return executor

    async def chat_completion(self, raw: bytes, max_model_len: Optional[int] = None) -> Prepared:
        return await self._submit("chat_completion", raw, max_model_len)

    async def completion(self, raw: bytes, max_model_len: Optional[int] = None) -> Prepared:
        return await self._submit("completion", raw, max_model_len)

    async def generate(self, raw: bytes, max_model_len: Optional[int] = None) -> list[int]:
        return await self._submit("generate", raw, max_model_len)

    async def _submit(self, method: str, arg: Any, max_model_len: Optional[int]) -> Any:
        limit = max_model_len if max_model_len is not None else self.max_model_len
        if limit is None:
            raise ValueError("PromptPool: a job needs a context limit (max_model_len)")
        if self.outstanding >= self.workers + self.queue:
            raise DispatchError(
                f"the router's tokenizer workers have {self.outstanding} prompts to prepare, their "
                "limit (--tokenizer-workers + --tokenizer-queue); retry shortly",
                grpc.StatusCode.RESOURCE_EXHAUSTED)
        loop = asyncio.get_running_loop()
        executor = self._executor
        try:
            job = executor.submit(_run, method, arg, limit)
        except BrokenProcessPool:
            raise self._broken(executor) from None
        self.outstanding += 1
        # Counted down on the loop when the worker is done with it (the
        # callback runs on the executor's thread).
        job.add_done_callback(lambda _: _call_soon(loop, self._done))
        try:
            return await asyncio.wrap_future(job)
        except BrokenProcessPool:
            raise self._broken(executor) from None

    def _done(self) -> None:
        self.outstanding -= 1

    def _broken(self, executor: concurrent.futures.ProcessPoolExecutor) -> Exception:
        """A worker died (killed, out of memory): start a new pool, once, and
        answer this request 503 with Retry-After."""
        if executor is self._executor:
            log.error("a tokenizer worker process died; starting new ones")
            executor.shutdown(wait=False, cancel_futures=True)
            # Not warmed: that would block the event loop; the next jobs start them.
            self._executor = self._start(warm=False)
        return DispatchError("the router's tokenizer worker stopped while preparing this request; "
                             "retry shortly", grpc.StatusCode.UNAVAILABLE)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback) -> None:
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # that loop has closed (a test's); nothing waits on it any more
        pass
