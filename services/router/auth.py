"""API keys: `Authorization: Bearer <key>` on HTTP, the same in gRPC metadata."""
from __future__ import annotations

import hmac

from tandem.services.router.http_errors import error_response
from tandem.services.router.telemetry import RouterTelemetry


def bearer_token(header: bytes) -> bytes:
    return header[7:] if header[:7].lower() == b"bearer " else b""


def key_matches(token: bytes, keys: list[bytes]) -> bool:
    # Compare against every key so timing does not say which one nearly matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok


class RequireAPIKey:
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
            if not key_matches(bearer_token(given), self.keys):
                self.telemetry.refused("401")
                response = error_response(401, "Missing or invalid API key: send 'Authorization: "
                                          "Bearer <key>'.", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
