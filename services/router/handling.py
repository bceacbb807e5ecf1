"""A /v1 request's way through the gateway, from its head to a status: an
in-flight slot, the body within its size and time limits, the prompt, the
endpoint, and every failure turned into OpenAI's error JSON.

A request takes an in-flight slot (--max-in-flight) only once its whole body
has arrived, and the body must arrive within --body-read-timeout: clients
that send slowly hold connections, never slots.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from tandem.services.router.dispatch import DispatchError
from tandem.services.router.frontend import Frontend, InvalidRequest, ModelView
from tandem.services.router.http_errors import CLOSE, RETRY, error_response
from tandem.services.router.prompter import Prepared
from tandem.services.router.sse import INTERNAL_ERROR, ClientGone
from tandem.services.router.telemetry import RequestClock, RouterTelemetry

log = logging.getLogger(__name__)

Prepare = Callable[[bytes, int], Awaitable[Prepared]]  # (body, the context limit) -> prompts
Endpoint = Callable[[Request, Prepared, ModelView, RequestClock], Awaitable[Response]]


@dataclass
class GatewayConfig:
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    max_body_bytes: int = 4 * 1024 * 1024
    max_in_flight: int = 1024  # requests beyond it get 429 with Retry-After
    body_read_timeout_s: float = 30.0  # a body not in by then gets 408


class RequestHandler:
    def __init__(self, frontend: Frontend, telemetry: RouterTelemetry, config: GatewayConfig) -> None:
        self.frontend = frontend
        self.telemetry = telemetry
        self.config = config

    def at_limit(self, headers: dict = RETRY) -> Optional[JSONResponse]:
        if self.telemetry.in_flight < self.config.max_in_flight:
            return None
        self.telemetry.refused("429")
        return error_response(429, f"The router has {self.telemetry.in_flight} requests in flight, its "
                              "limit; retry shortly.", headers=headers)

    async def read_body(self, request: Request) -> bytes:
        """The whole body, within the size and time limits (413, 408)."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise InvalidRequest(f"The body is {length} bytes; the limit is {limit} "
                                 "(--max-body-bytes on the router).", status=413)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise InvalidRequest(f"The body is over the limit of {limit} bytes "
                                             "(--max-body-bytes on the router).", status=413)
                    chunks.append(chunk)
        except TimeoutError:
            raise InvalidRequest(
                f"The body did not arrive within {self.config.body_read_timeout_s:g} s "
                "(--body-read-timeout on the router); send it in one go.",
                status=408, code="request_timeout") from None
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    async def __call__(self, request: Request, prepare: Prepare, endpoint: Endpoint) -> Response:
        telemetry = self.telemetry
        if refused := self.at_limit({**RETRY, **CLOSE}):  # before reading a body only to drop it
            return refused
        try:
            raw = await self.read_body(request)
        except InvalidRequest as exc:
            telemetry.refused(str(exc.status))
            return error_response(exc.status, exc.message, exc.param, exc.code, headers=CLOSE)
        except ClientGone:
            telemetry.refused("499")
            log.info("%s %s: the client closed the connection while sending its body",
                     request.method, request.url.path)
            return Response(status_code=499)
        # Only now does the request take a slot: a body still arriving holds none.
        if refused := self.at_limit():
            return refused
        clock = telemetry.start()
        try:
            # One view of the engines for the whole request: its prompt and
            # max_tokens are checked against the same context limit.
            view = self.frontend.view()
            prepared = await prepare(raw, view.max_model_len)
            self.frontend.check_model(prepared.body.model)
            response = await endpoint(request, prepared, view, clock)
            if not isinstance(response, StreamingResponse):
                clock.finish(str(response.status_code))
            return response
        except InvalidRequest as exc:
            clock.finish(str(exc.status))
            return error_response(exc.status, exc.message, exc.param, exc.code)
        except DispatchError as exc:
            clock.finish(str(exc.http_status))
            retry = RETRY if exc.http_status in (429, 503) else None
            return error_response(exc.http_status, exc.message, headers=retry)
        except ClientGone:
            clock.finish("499")  # nginx's "client closed request"
            log.info("%s %s: the client closed the connection after %.1f s; request cancelled",
                     request.method, request.url.path, time.monotonic() - clock.arrival)
            return Response(status_code=499)  # nobody reads it; returning keeps uvicorn quiet
        except Exception:
            # Answered here, not re-raised: uvicorn would log it a second time.
            log.exception("%s %s failed", request.method, request.url.path)
            clock.finish("500")
            return error_response(500, INTERNAL_ERROR)
        except BaseException:  # cancelled by the server (shutting down)
            clock.finish("499")
            raise
