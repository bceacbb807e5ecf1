"""One choice of one request through the tiers: prefill (unless the prompt is
short or no prefill instance is up), then decode, streaming deltas back.

Prefill answers with the first token's id (and logprob) only; the decode
engine detokenizes it with the rest and applies every stop rule, so the text
through prefill -> decode is exactly a colocated engine's.

Failure handling. A call is retried on another instance only when the request
never reached an engine there: the engine sends ADMITTED_METADATA once it
has taken a request in, and a call that failed without it (connection
refused, a draining or dead engine, a full queue) is safe to send on. A
request that an engine took and then failed on is not sent to the next one:
whatever it did to that engine it could do to every other (a poison request
must cost one engine at most, and with failure isolation in the engine, none).
- a prefill instance that refuses (unreachable, draining, dead) is taken out
  and the prompt goes to another; with none left, decode prefills the prompt
  itself; a full one (RESOURCE_EXHAUSTED) stays in the pool;
- the same for decode before it took the request; a full decode tier is a
  RESOURCE_EXHAUSTED for the client (HTTP 429), except after prefill, when
  the request waits up to decode_queue_wait_s for room;
- a failure after admission ends the choice with a DispatchError: an engine
  failure is UNAVAILABLE (HTTP 503 with Retry-After), a bad request
  INVALID_ARGUMENT (400);
- closing or cancelling the generator cancels the gRPC calls, which aborts the
  request in the engines.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

import grpc

from tandem.services.common.engine_protocol import ADMITTED_METADATA
from tandem.services.router.backends import INSTANCE_FAILURES, BackendPool, Instance
from tandem.services.router.policies import Policy, RouteRequest
from tandem.services.router.telemetry import RouterTelemetry
from tandem.v1 import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger(__name__)

# gRPC code -> HTTP status, for errors the router passes on to clients.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.INTERNAL: 500,  # an engine broke on this request alone (not retried)
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.ABORTED: 503,
}


class DispatchError(Exception):
    """A request failed downstream; carries what to tell the client."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self.code, 502)

    @classmethod
    def from_rpc(cls, role: str, target: str, exc: grpc.aio.AioRpcError) -> "DispatchError":
        if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return cls(exc.details() or "invalid request", exc.code())
        if exc.code() == grpc.StatusCode.CANCELLED:
            # The router's own cancellations surface as asyncio.CancelledError,
            # never as an AioRpcError: this one came from the instance. Its gRPC
            # server cancels calls it has no room to take in (more than
            # grpc.server.max_pending_requests, 1000 by default, waiting for the
            # servicer) or that it drops as it stops. The instance is overloaded
            # or going away, the request is fine: tell the client to retry.
            return cls(f"{role} instance {target} is overloaded: it shed the call (CANCELLED); "
                       "retry shortly", grpc.StatusCode.RESOURCE_EXHAUSTED)
        return cls(f"{role} instance {target} failed: {exc.code().name}: {exc.details()}", exc.code())


@dataclass
class Delta:
    """New output of one choice. The last delta of a choice has finish_reason
    and the usage numbers."""

    token_ids: list[int]
    text: str
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class Dispatcher:
    def __init__(self, prefill: BackendPool, decode: BackendPool, prefill_policy: Policy,
                 decode_policy: Policy, prefill_threshold: int, telemetry: RouterTelemetry,
                 prefill_timeout_s: float = 300.0, decode_queue_wait_s: float = 30.0) -> None:
        self.prefill = prefill
        self.decode = decode
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.prefill_threshold = prefill_threshold
        self.telemetry = telemetry
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_queue_wait_s = decode_queue_wait_s
        self._decode_full_until = 0.0  # monotonic time until which new requests get 429
        self.releases: set[asyncio.Future] = set()  # ReleaseKV calls in flight

    async def generate(self, request_id: str, prompt: Sequence[int],
                       params: common_pb2.SamplingParams) -> AsyncIterator[Delta]:
        if time.monotonic() < self._decode_full_until:
            # The decode tier just said it is full: refuse now (429) rather than
            # prefill a request that would then wait for decode room.
            raise DispatchError("every decode instance is at its queue limit; retry shortly",
                                grpc.StatusCode.RESOURCE_EXHAUSTED)
        route = RouteRequest(prompt_token_ids=prompt)
        reply, source = None, None
        if len(prompt) >= self.prefill_threshold and self.prefill.instances:
            reply, source = await self._prefill(request_id, prompt, params, route)
        if reply is None:
            self.telemetry.prefill_skipped()
        held = None
        if reply is not None and reply.HasField("kv_handle"):
            # The prefill holds the prompt's blocks for the decode to copy
            # (direct transfer): release them once decode has streamed (the
            # copy happens in the step that produces its first message), or
            # when this request ends without getting that far.
            held = _HeldKV(self, source, request_id)
        try:
            async for delta in self._generate(request_id, prompt, params, route, reply, held):
                yield delta
        finally:
            if held is not None:
                held.release()

    async def _generate(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                        route: RouteRequest, reply: Optional[prefill_pb2.PrefillResponse],
                        held: Optional["_HeldKV"]) -> AsyncIterator[Delta]:
        first: list[int] = []
        first_logprobs: list[common_pb2.TokenLogprob] = []
        cached: Optional[int] = None
        if reply is not None:
            first = [reply.first_token_id]
            if reply.HasField("logprob"):
                first_logprobs = [reply.logprob]
            cached = reply.num_cached_tokens + reply.num_external_tokens
        kv_handle = reply.kv_handle if held is not None else None
        store_write = reply.kv_store_write if reply is not None and reply.HasField("kv_store_write") else None
        async for msg in self._decode(request_id, prompt, first, params, route, kv_handle, store_write):
            if held is not None:
                held.release()
            # Decode's first message carries the prefill's tokens (their text
            # and stop rules are decode's); their logprobs come from prefill.
            delta = Delta(token_ids=list(msg.token_ids), text=msg.text,
                          logprobs=first_logprobs + list(msg.logprobs))
            first_logprobs = []
            if msg.finish_reason:
                delta.finish_reason = msg.finish_reason
                delta.num_prompt_tokens = msg.num_prompt_tokens or len(prompt)
                delta.num_output_tokens = msg.num_output_tokens
                delta.num_cached_tokens = (cached if cached is not None
                                           else msg.num_cached_tokens + msg.num_external_tokens)
            yield delta

    def _candidates(self, pool: BackendPool, tried: set[str]) -> list[Instance]:
        return [i for i in pool.healthy() if i.target not in tried]

    async def _prefill(self, request_id: str, prompt: Sequence[int], params: common_pb2.SamplingParams,
                       route: RouteRequest) -> tuple[Optional[prefill_pb2.PrefillResponse], Optional[Instance]]:
        """The prefill reply and the instance that gave it, or (None, None) when
        no prefill instance could take it."""
        tried: set[str] = set()
        request = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                             params=params)
        while candidates := self._candidates(self.prefill, tried):
            instance = self.prefill_policy.choose(candidates, route)
            tried.add(instance.target)
            self.telemetry.routed("prefill", instance.target)
            instance.outstanding_tokens += len(prompt)
            instance.in_flight += 1
            try:
                return await instance.stub.Prefill(request, timeout=self.prefill_timeout_s), instance
            except grpc.aio.AioRpcError as exc:
                if not self._may_retry(self.prefill, instance, exc):
                    raise DispatchError.from_rpc("prefill", instance.target, exc) from None
            finally:
                instance.outstanding_tokens -= len(prompt)
                instance.in_flight -= 1
        return None, None

    async def _decode(self, request_id: str, prompt: Sequence[int], first: list[int],
                      params: common_pb2.SamplingParams, route: RouteRequest,
                      kv_handle: Optional[common_pb2.KVHandle] = None,
                      store_write: Optional[common_pb2.KVStoreWrite] = None
                      ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        tried: set[str] = set()
        full = 0
        request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                           first_token_ids=first, params=params, kv_handle=kv_handle,
                                           kv_store_write=store_write)
        deadline = time.monotonic() + self.decode_queue_wait_s
        while True:
            candidates = self._candidates(self.decode, tried)
            if not candidates and full:
                self._decode_full_until = time.monotonic() + DECODE_FULL_HOLD_S
            if not candidates and full and first and time.monotonic() < deadline:
                # Prefill already ran for this request: wait for a decode queue to
                # make room rather than throw that work away, then try them again.
                await asyncio.sleep(0.25)
                tried.clear()
                full = 0
                continue
            if not candidates and full:
                raise DispatchError(f"every decode instance is at its queue limit ({full} tried); "
                                    "retry shortly", grpc.StatusCode.RESOURCE_EXHAUSTED)
            if not candidates:
                raise DispatchError("no healthy decode instance; retry later", grpc.StatusCode.UNAVAILABLE)
            instance = self.decode_policy.choose(candidates, route)
            tried.add(instance.target)
            self.telemetry.routed("decode", instance.target)
            instance.in_flight += 1
            call = instance.stub.Decode(request)
            streamed = False
            try:
                async for msg in call:
                    streamed = True
                    yield msg
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _FULL and not _admitted(exc):
                    full += 1
                    continue  # full, not broken: try the next one
                if not self._may_retry(self.decode, instance, exc):
                    if streamed and exc.code() in INSTANCE_FAILURES:
                        raise DispatchError(f"decode instance {instance.target} failed mid-stream: "
                                            f"{exc.code().name}: {exc.details()}") from None
                    raise DispatchError.from_rpc("decode", instance.target, exc) from None
            finally:
                instance.in_flight -= 1
                # No-op when the call ended; otherwise (client gone, generator
                # closed) it cancels the RPC and so aborts the request in decode.
                call.cancel()


    def _may_retry(self, pool: BackendPool, instance: Instance, exc: grpc.aio.AioRpcError) -> bool:
        """After a failed call: may the request go to another instance? Takes
        the instance out of the pool where the failure says it is unusable."""
        code, admitted = exc.code(), _admitted(exc)
        if code in _FULL and not admitted:
            return True  # full, not broken: it stays in the pool
        if code not in INSTANCE_FAILURES:
            return False  # the request's own fault (bad argument), or cancelled
        if code == grpc.StatusCode.UNAVAILABLE:
            # Unreachable, draining, or its engine died: out until a health check passes.
            self.telemetry.backend_failed(pool.role, instance.target)
            pool.mark_failed(instance, f"{code.name}: {exc.details()}")
        retry = code == grpc.StatusCode.UNAVAILABLE and not admitted
        self.telemetry.instance_error(pool.role, retried=retry)
        if not retry:
            log.warning("%s instance %s failed a request%s (%s: %s); not sending it elsewhere",
                        pool.role, instance.target, " it had taken in" if admitted else "",
                        code.name, exc.details())
        return retry


# An instance too busy to take a call: its queue is full (RESOURCE_EXHAUSTED),
# or gRPC itself shed the call before a handler took it (a server-sent
# CANCELLED; the router's own cancellations surface as asyncio.CancelledError).
_FULL = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


def _admitted(exc: grpc.aio.AioRpcError) -> bool:
    """Did the engine take the request in before the call failed?"""
    return any(item == ADMITTED_METADATA[0] for item in (exc.initial_metadata() or ()))


class _HeldKV:
    """A prompt's blocks a prefill instance holds for the decode (direct
    transfer). release() tells it, once, without waiting for the answer: a
    release that fails only means the prefill's hold timeout frees them."""

    RELEASE_TIMEOUT_S = 5.0

    def __init__(self, dispatcher: Dispatcher, instance: Instance, request_id: str) -> None:
        self.dispatcher = dispatcher
        self.instance = instance
        self.request_id = request_id
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            call = self.instance.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(request_id=self.request_id),
                                                timeout=self.RELEASE_TIMEOUT_S)
            task = asyncio.ensure_future(call)
        except RuntimeError as exc:  # no running loop (a generator finalised outside it)
            log.warning("could not release held KV blocks of %s (the hold timeout frees them): %s",
                        self.request_id, exc)
            return
        tasks = self.dispatcher.releases
        tasks.add(task)  # a reference until it ends, so it is not collected mid-flight
        task.add_done_callback(tasks.discard)
        task.add_done_callback(_release_done)


def _release_done(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("releasing held KV blocks failed (the prefill's hold timeout frees them): %s",
                    task.exception())


_DONE = object()
# After every decode instance refused a request as full, new requests get 429
# at the door for this long, so requests already prefilled get the room first.
DECODE_FULL_HOLD_S = 1.0


async def merge_choices(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave the deltas of n choices as they come: (choice index, delta).

    The first error of any choice ends all of them; leaving early cancels the rest.
    """
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, _DONE))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
