"""The PromptPool: Prompter (prompter.py) in worker processes, off the event loop.

Preparing a prompt is the router's CPU-heavy work, and it grows with the
body: for a 4 MiB body of 90k chat messages, parsing takes 0.4 s, the chat
template (pure Python jinja) 0.5 s, tokenizing 2-3 s. On the event loop that
froze every other stream for as long, so it runs in a PromptPool of worker
processes. Processes, not threads: the parser, the template and the
tokenizer all hold the GIL, pydantic for the whole 0.4 s parse. Measured on a
2-core `tandem up --prefill 2 --decode 2`, the longest gap of another stream
(one chunk per token, 50 ms median) while a 90k-message body was prepared:
2.5-3.0 s on the event loop, 340-520 ms in a thread, 60-110 ms in a worker
process (the stream alone: 55-65 ms). A worker gets the raw body and sends
back the parsed request without its bulk (messages, prompts) plus the token
ids, so the loop copies bytes and never walks the body.
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
from typing import Any, Optional

import grpc

from tandem.services.common.parent_death import die_with_parent
from tandem.services.router.dispatch import DispatchError
from tandem.services.router.prompter import InvalidRequest, Prepared, Prompter

__all__ = ["InvalidRequest", "Prepared", "PromptPool"]

log = logging.getLogger(__name__)

_worker: Optional[Prompter] = None  # the Prompter of this worker process
WORKER_NICENESS = 10


def _init_worker(tokenizer_blob: bytes, max_choices: int) -> None:
    global _worker
    # Ctrl+C reaches the whole process group; the router stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    # Below the event loop: where CPUs are short, streams under way go first and
    # a huge body waits for its tokens (it is refused or served later anyway).
    os.nice(WORKER_NICENESS)
    _worker = Prompter(pickle.loads(tokenizer_blob), max_choices)


def _run(method: str, arg: Any, max_model_len: int) -> Any:
    return getattr(_worker, method)(arg, max_model_len)


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

    async def tokenize(self, raw: bytes, max_model_len: Optional[int] = None) -> Prepared:
        return await self._submit("tokenize", raw, max_model_len)

    async def detokenize(self, raw: bytes, max_model_len: Optional[int] = None) -> Prepared:
        return await self._submit("detokenize", raw, max_model_len)

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
