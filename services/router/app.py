"""The OpenAI-compatible HTTP gateway (FastAPI): /v1/chat/completions,
/v1/completions (SSE streaming and not), /v1/models, /health, /metrics.

Every error is OpenAI's error JSON with a status that says whose fault it was;
a client that goes away aborts its request in every tier.

A request takes an in-flight slot (--max-in-flight) only once its whole body
has arrived, and the body must arrive within --body-read-timeout: clients
that send slowly hold connections, never slots.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tandem.services.router.backends import BackendPool
from tandem.services.router.dispatch import Delta, DispatchError, merge_choices
from tandem.services.router.frontend import Frontend, InvalidRequest, new_request_id
from tandem.services.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                    LogprobFormatter, error_body, now, usage_body)
from tandem.services.router.prompts import Prepared
from tandem.services.router.telemetry import RequestClock, RouterTelemetry

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5


@dataclass
class GatewayConfig:
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    max_body_bytes: int = 4 * 1024 * 1024
    max_in_flight: int = 1024  # requests beyond it get 429 with Retry-After
    body_read_timeout_s: float = 30.0  # a body not in by then gets 408


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
           headers: Optional[dict] = None) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        type_ = "authentication_error"
    elif status == 429:
        type_ = "rate_limit_error"
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


# An answer sent before the request's body was read: the connection cannot
# carry another request (the rest of the body is still coming), so close it.
_CLOSE = {"Connection": "close"}
_RETRY = {"Retry-After": "1"}


class _RequireAPIKey:
    """Every route but /health needs `Authorization: Bearer <key>` when keys are set.

    Plain ASGI on purpose: Starlette's BaseHTTPMiddleware (@app.middleware)
    wraps `receive` so that request.is_disconnected() never sees a client that
    hung up before the response started, and the request would run on."""

    def __init__(self, app, keys: list[str], telemetry: RouterTelemetry) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.telemetry = telemetry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            # Compare against every key so timing does not say which one nearly matched.
            ok = False
            for key in self.keys:
                ok |= hmac.compare_digest(token, key)
            if not ok:
                self.telemetry.refused("401")
                response = _error(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                  code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class _Choice:
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, delta: Delta, count_prompt: bool) -> None:
        self.completion_tokens += delta.num_output_tokens
        if count_prompt:
            self.prompt_tokens += delta.num_prompt_tokens
            self.cached_tokens += delta.num_cached_tokens

    def body(self) -> dict:
        return usage_body(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def create_app(frontend: Frontend, telemetry: RouterTelemetry, pools: dict[str, BackendPool],
               config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="tandem", summary="OpenAI-compatible gateway of tandem")
    formatter = LogprobFormatter(frontend.model.tokenizer)

    # --- cross-cutting: auth, body size, errors ----------------------------------------

    app.add_middleware(_RequireAPIKey, keys=config.api_keys, telemetry=telemetry)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # The /v1 routes answer their own errors (handle() below); only the
        # others get here. Starlette re-raises the exception after this answer
        # and uvicorn logs it with its traceback: logging it here too would log
        # it twice.
        return _error(500, "Internal error in the router; see its log.")

    def at_limit(headers: dict = _RETRY) -> Optional[JSONResponse]:
        if telemetry.in_flight < config.max_in_flight:
            return None
        telemetry.refused("429")
        return _error(429, f"The router has {telemetry.in_flight} requests in flight, its limit; "
                      "retry shortly.", headers=headers)

    async def read_body(request: Request) -> bytes:
        """The whole body, within the size and time limits (413, 408)."""
        limit = config.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise InvalidRequest(f"The body is {length} bytes; the limit is {limit} "
                                 "(--max-body-bytes on the router).", status=413)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(config.body_read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise InvalidRequest(f"The body is over the limit of {limit} bytes "
                                             "(--max-body-bytes on the router).", status=413)
                    chunks.append(chunk)
        except TimeoutError:
            raise InvalidRequest(
                f"The body did not arrive within {config.body_read_timeout_s:g} s "
                "(--body-read-timeout on the router); send it in one go.",
                status=408, code="request_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    async def handle(request: Request, prepare: Callable[[bytes], Awaitable[Prepared]],
                     run: Callable[[Request, Prepared, RequestClock], Awaitable[Response]]):
        if refused := at_limit({**_RETRY, **_CLOSE}):  # before reading a body only to drop it
            return refused
        try:
            raw = await read_body(request)
        except InvalidRequest as exc:
            telemetry.refused(str(exc.status))
            return _error(exc.status, exc.message, exc.param, exc.code, headers=_CLOSE)
        except ClientGone:
            telemetry.refused("499")
            log.info("%s %s: the client closed the connection while sending its body",
                     request.method, request.url.path)
            return Response(status_code=499)
        # Only now does the request take a slot: a body still arriving holds none.
        if refused := at_limit():
            return refused
        clock = telemetry.start()
        try:
            prepared = await prepare(raw)
            frontend.check_model(prepared.body.model)
            response = await run(request, prepared, clock)
            if not isinstance(response, StreamingResponse):
                clock.finish(str(response.status_code))
            return response
        except InvalidRequest as exc:
            clock.finish(str(exc.status))
            return _error(exc.status, exc.message, exc.param, exc.code)
        except DispatchError as exc:
            clock.finish(str(exc.http_status))
            retry = _RETRY if exc.http_status in (429, 503) else None
            return _error(exc.http_status, exc.message, headers=retry)
        except ClientGone:
            clock.finish("499")  # nginx's "client closed request"
            log.info("%s %s: the client closed the connection after %.1f s; request cancelled",
                     request.method, request.url.path, time.monotonic() - clock.arrival)
            return Response(status_code=499)  # nobody reads it; returning keeps uvicorn quiet
        except Exception:
            # Answered here, not re-raised: uvicorn would log it a second time.
            log.exception("%s %s failed", request.method, request.url.path)
            clock.finish("500")
            return _error(500, "Internal error in the router; see its log.")
        except BaseException:  # cancelled by the server (shutting down)
            clock.finish("499")
            raise

    # --- routes -----------------------------------------------------------------------

    @app.get("/health")
    async def health():
        counts = {role: {"healthy": len(pool.healthy()), "total": len(pool.instances)}
                  for role, pool in pools.items()}
        ok = bool(pools["decode"].healthy())
        return JSONResponse({"status": "ok" if ok else "unavailable", "instances": counts},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from tandem.services.common.metrics import metrics_response

        body, content_type = metrics_response()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        m = frontend.model
        return {"object": "list", "data": [{"id": m.model_id, "object": "model", "created": now(),
                                            "owned_by": "tandem", "max_model_len": m.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, frontend.prompts.chat_completion, _chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, frontend.prompts.completion, _completion)

    # --- chat -------------------------------------------------------------------------

    async def _chat(request: Request, prepared: Prepared, clock: RequestClock) -> Response:
        body: ChatCompletionRequest = prepared.body
        prompt = prepared.prompts[0]
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs set to true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, logprobs)
        frontend.finalize_params(len(prompt), params)
        request_id = new_request_id("chatcmpl")
        created, model_id = now(), frontend.model.model_id
        stream = frontend.generate(request_id, prompt, params)
        if body.stream:
            stream = await _primed(request, stream, clock)

        def chunk(index: int, delta: dict, lps: Optional[list], finish: Optional[str]) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model_id, "choices": [{"index": index, "delta": delta, "logprobs": lps,
                                                    "finish_reason": finish}]}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncIterator[dict]:
                usage = _Usage()
                for i in range(params.n or 1):
                    yield chunk(i, {"role": "assistant", "content": ""}, None, None)
                async for index, d in stream:
                    clock.on_tokens(len(d.token_ids))
                    lps = {"content": formatter.chat(d.logprobs)} if logprobs is not None else None
                    if d.text or d.finish_reason or lps:
                        yield chunk(index, {"content": d.text} if d.text else {}, lps, d.finish_reason)
                    if d.finish_reason:
                        usage.add(d, count_prompt=index == 0)
                if include_usage:
                    yield {"id": request_id, "object": "chat.completion.chunk", "created": created,
                           "model": model_id, "choices": [], "usage": usage.body()}

            return _sse(request, events(), clock)

        choices, usage = await _collect(request, stream, clock, prompts_per_choice=params.n or 1)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": {"content": formatter.chat(c.logprobs)} if logprobs is not None else None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": usage.body()})

    # --- completions --------------------------------------------------------------------

    async def _completion(request: Request, prepared: Prepared, clock: RequestClock) -> Response:
        body: CompletionRequest = prepared.body
        if body.echo:
            raise InvalidRequest("echo: not supported", param="echo")
        if body.suffix:
            raise InvalidRequest("suffix: not supported", param="suffix")
        prompts = prepared.prompts
        n = body.n
        request_id = new_request_id("cmpl")
        created, model_id = now(), frontend.model.model_id
        per_prompt = []
        for pi, prompt in enumerate(prompts):
            params = body.sampling_params(body.max_tokens, body.logprobs)
            frontend.finalize_params(len(prompt), params)
            per_prompt.append(frontend.generate(f"{request_id}-p{pi}", prompt, params))

        async def flat() -> AsyncIterator[tuple[int, Delta]]:
            async for pi, (ci, d) in merge_choices(per_prompt):
                yield pi * n + ci, d

        stream = flat()
        if body.stream:
            stream = await _primed(request, stream, clock)
        with_logprobs = body.logprobs is not None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncIterator[dict]:
                usage = _Usage()
                offsets: dict[int, int] = {}
                async for index, d in stream:
                    clock.on_tokens(len(d.token_ids))
                    lps = None
                    if with_logprobs:
                        lps = formatter.completion(d.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(d.text)
                    if d.text or d.finish_reason or lps:
                        yield {"id": request_id, "object": "text_completion", "created": created,
                               "model": model_id, "choices": [{"index": index, "text": d.text,
                                                               "logprobs": lps,
                                                               "finish_reason": d.finish_reason}]}
                    if d.finish_reason:
                        usage.add(d, count_prompt=index % n == 0)
                if include_usage:
                    yield {"id": request_id, "object": "text_completion", "created": created,
                           "model": model_id, "choices": [], "usage": usage.body()}

            return _sse(request, events(), clock)

        choices, usage = await _collect(request, stream, clock, prompts_per_choice=n)
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": model_id,
            "choices": [{"index": i, "text": c.text,
                         "logprobs": formatter.completion(c.logprobs, 0) if with_logprobs else None,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": usage.body()})

    return app


# --- running a generation against a client that may leave ----------------------------

async def _until_disconnect(request: Request, work: asyncio.Task) -> None:
    """Wait for `work`; cancel it (and so every downstream call) if the client leaves."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return
        if await request.is_disconnected():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return


async def _primed(request: Request, stream: AsyncIterator, clock: RequestClock) -> AsyncIterator:
    """Wait for a stream's first delta before the status line goes out, so that a
    request refused downstream (every queue full, no decode instance, invalid)
    gets its real status (429, 503, 400) instead of a 200 and an error event.
    Returns the same stream, first delta included."""
    first = asyncio.ensure_future(stream.__anext__())
    await _until_disconnect(request, first)
    if first.cancelled():
        await stream.aclose()
        raise ClientGone()
    try:
        head = [first.result()]
    except StopAsyncIteration:
        head = []
    except BaseException:
        await stream.aclose()
        raise

    async def replay() -> AsyncIterator:
        try:
            for item in head:
                yield item
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    return replay()


async def _collect(request: Request, stream: AsyncIterator[tuple[int, Delta]], clock: RequestClock,
                   prompts_per_choice: int) -> tuple[list[_Choice], _Usage]:
    choices: dict[int, _Choice] = {}
    usage = _Usage()

    async def consume() -> None:
        async for index, d in stream:
            clock.on_tokens(len(d.token_ids))
            c = choices.setdefault(index, _Choice())
            c.text += d.text
            c.logprobs.extend(d.logprobs)
            if d.finish_reason:
                c.finish_reason = d.finish_reason
                usage.add(d, count_prompt=index % prompts_per_choice == 0)

    work = asyncio.create_task(consume())
    await _until_disconnect(request, work)
    if work.cancelled():
        raise ClientGone()
    work.result()  # re-raises DispatchError
    return [choices[i] for i in sorted(choices)], usage


def _sse(request: Request, events: AsyncIterator[dict], clock: RequestClock) -> StreamingResponse:
    """Server-sent events; a downstream failure mid-stream becomes an error event
    (the status line is long gone), a client that leaves cancels the generation."""
    queue: asyncio.Queue = asyncio.Queue()
    END = object()

    async def produce() -> None:
        try:
            async for event in events:
                await queue.put(f"data: {json.dumps(event)}\n\n")
            await queue.put("data: [DONE]\n\n")
            clock.finish("200")
        except InvalidRequest as exc:
            clock.finish(str(exc.status))
            await queue.put(f"data: {json.dumps(error_body(exc.message, 'invalid_request_error', exc.param, exc.code))}\n\n")
        except DispatchError as exc:
            clock.finish(str(exc.http_status))
            await queue.put(f"data: {json.dumps(error_body(exc.message, 'server_error', None, exc.http_status))}\n\n")
        except asyncio.CancelledError:
            if not clock.done:
                log.info("%s %s: the client closed the connection mid-stream; request cancelled",
                         request.method, request.url.path)
            clock.finish("499")
            raise
        except Exception:
            log.exception("%s %s: the stream failed", request.method, request.url.path)
            clock.finish("500")
            await queue.put(f"data: {json.dumps(error_body('Internal error in the router; see its log.', 'server_error', None, 500))}\n\n")
        finally:
            await events.aclose()
            queue.put_nowait(END)

    async def body() -> AsyncIterator[str]:
        work = asyncio.create_task(produce())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if item is END:
                    return
                yield item
        finally:
            # Leaving early (client gone, or starlette closing us): stop the generation.
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
