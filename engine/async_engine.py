"""An asyncio face for services: the engine steps on its own thread; each
request's outputs reach its caller through an asyncio queue.

Only the engine thread touches the engine; callers hand it commands through a
thread-safe queue. A caller that stops listening (cancelled, generator
closed) aborts its request, so its blocks go back to the pool.

Two kinds of failure, kept apart: a request the engine fails alone ends its
caller's stream with RequestFailedError while the engine steps on; a failure
of the engine itself (its loop raised) fails every caller with
EngineDeadError and calls `on_death`, so the service can stop looking
healthy and exit for its supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence

from tandem.engine.config import EngineConfig
from tandem.engine.connector.base import KVStore
from tandem.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from tandem.engine.request import SamplingParams

log = logging.getLogger(__name__)

_FAILED = object()  # marker put on a request's queue when the engine failed it


class EngineDeadError(RuntimeError):
    """The engine's loop has stopped: no request can run in this process any more."""


class InjectedFault(RuntimeError):
    """Raised in the engine loop by inject_fault() (fault tests)."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, engine: Optional[LLMEngine] = None,
                 on_death: Optional[Callable[[BaseException], None]] = None,
                 kv_store: Optional[KVStore] = None) -> None:
        """on_death(exc): called once, on the engine thread, when the loop dies.
        kv_store: see LLMEngine."""
        self.engine = engine or LLMEngine(config, kv_store=kv_store)
        self.tokenizer = self.engine.tokenizer
        self.model_id = self.engine.model_id
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats: EngineStats = self.engine.stats()
        self._stopped = threading.Event()
        self.error: Optional[BaseException] = None
        self._on_death = on_death
        self._fault: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # ---- the engine thread ----------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                if self._fault is not None:
                    raise InjectedFault(self._fault)
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                if self.engine.last_step_empty:
                    # Nothing could run (requests wait on KV fetches): do not spin.
                    self._wakeup.wait(0.002)
                    self._wakeup.clear()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the engine is broken: fail every caller, loudly
            log.exception("engine loop died")
            self.error = exc
            # First the service (health turns NOT_SERVING), then the callers.
            if self._on_death is not None:
                try:
                    self._on_death(exc)
                except Exception:
                    log.exception("on_death callback failed")
            for rid in list(self._streams):
                self._deliver(rid, _FAILED)
            self._fail_queued_adds()

    def _fail_queued_adds(self) -> None:
        """Requests handed over after the loop's last drain: their callers
        wait on `added`, which must fail now. (generate() checks `error`
        after queueing its command, and `error` is set before this runs, so
        no caller is missed.)"""
        for kind, args in self._queued_commands():
            if kind == "add":
                rid, *_, fut_loop, fut = args
                self._streams.pop(rid, None)
                fut_loop.call_soon_threadsafe(
                    _set_exception, fut, EngineDeadError(f"the engine failed: {self.error!r}"))

    def inject_fault(self, reason: str = "injected fault") -> None:
        """Make the engine loop raise at its next iteration, as a real engine
        failure would (fault tests; services wire it only when asked to)."""
        self._fault = reason
        self._wakeup.set()

    def _queued_commands(self) -> Iterator[tuple[str, Any]]:
        """(kind, args) of every command queued now, taken off the queue."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for kind, args in self._queued_commands():
            if kind == "add":
                rid, prompt, params, first, kv_transfer_params, fut_loop, fut = args
                try:
                    self.engine.add_request(rid, prompt, params, first,
                                            kv_transfer_params=kv_transfer_params)
                    fut_loop.call_soon_threadsafe(_set_result, fut, None)
                except Exception as exc:  # invalid request: the caller gets the error
                    self._streams.pop(rid, None)
                    fut_loop.call_soon_threadsafe(_set_exception, fut, exc)
            elif kind == "abort":
                self.engine.abort(args)
                self._streams.pop(args, None)
            elif kind == "release_kv":
                self.engine.release_kv(args)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        if item is _FAILED or item.finished:
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, item)

    # ---- the caller's side ---------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       first_token_ids: Optional[Sequence[int]] = None,
                       kv_transfer_params: Optional[dict] = None) -> AsyncIterator[RequestOutput]:
        if self.error is not None or self._stopped.is_set():
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        self._streams[request_id] = (loop, q)
        self._commands.put(("add", (request_id, list(prompt_token_ids), params,
                                    list(first_token_ids or []), kv_transfer_params, loop, added)))
        self._wakeup.set()
        if self.error is not None:
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        await added  # raises the engine's validation error, if any
        finished = False
        try:
            while True:
                item = await q.get()
                if item is _FAILED:
                    raise EngineDeadError(f"the engine failed: {self.error!r}")
                if item.error is not None:
                    finished = True  # the engine already let the request go
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def release_kv(self, request_id: str) -> None:
        """A finished request's KV was taken (direct transfer): let it go, on the engine thread."""
        self._commands.put(("release_kv", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._wakeup.set()
        self._thread.join(timeout_s)
        self.engine.shutdown()


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
