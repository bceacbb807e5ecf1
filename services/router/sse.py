"""A generation against a client that may leave: server-sent events, priming
a stream before its status line, and cancelling downstream work (every gRPC
call of every choice) when the client disconnects.

Starlette tells a handler of a disconnect only when asked, so each wait
polls `request.is_disconnected()` every DISCONNECT_POLL_S.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.services.router.dispatch import DispatchError
from tandem.services.router.openai_protocol import error_body
from tandem.services.router.prompter import InvalidRequest
from tandem.services.router.telemetry import RequestClock

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
INTERNAL_ERROR = "Internal error in the router; see its log."


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def until_disconnect(request: Request, work: asyncio.Task) -> None:
    """Wait for `work`; cancel it (and so every downstream call) if the client leaves."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return
        if await request.is_disconnected():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return


async def primed(request: Request, stream: AsyncIterator) -> AsyncIterator:
    """Wait for a stream's first item before the status line goes out, so that a
    request refused downstream (every queue full, no decode instance, invalid)
    gets its real status (429, 503, 400) instead of a 200 and an error event.
    Returns the same stream, first item included."""
    first = asyncio.ensure_future(stream.__anext__())
    await until_disconnect(request, first)
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


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def sse_response(request: Request, events: AsyncIterator[dict], clock: RequestClock) -> StreamingResponse:
    """Server-sent events; a downstream failure mid-stream becomes an error event
    (the status line is long gone), a client that leaves cancels the generation."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def produce() -> None:
        try:
            async for event in events:
                await queue.put(_event(event))
            await queue.put("data: [DONE]\n\n")
            clock.finish("200")
        except InvalidRequest as exc:
            clock.finish(str(exc.status))
            await queue.put(_event(error_body(exc.message, "invalid_request_error", exc.param, exc.code)))
        except DispatchError as exc:
            clock.finish(str(exc.http_status))
            await queue.put(_event(error_body(exc.message, "server_error", None, exc.http_status)))
        except asyncio.CancelledError:
            if not clock.done:
                log.info("%s %s: the client closed the connection mid-stream; request cancelled",
                         request.method, request.url.path)
            clock.finish("499")
            raise
        except Exception:
            log.exception("%s %s: the stream failed", request.method, request.url.path)
            clock.finish("500")
            await queue.put(_event(error_body(INTERNAL_ERROR, "server_error", None, 500)))
        finally:
            await events.aclose()
            queue.put_nowait(end)

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
                if item is end:
                    return
                yield item
        finally:
            # Leaving early (client gone, or starlette closing us): stop the generation.
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
