"""The OpenAI-compatible HTTP gateway (FastAPI): /v1/chat/completions,
/v1/completions (SSE streaming and not), /v1/models, vLLM's /tokenize and
/detokenize, /health, /metrics.

This module wires routes to their parts: auth.py (API keys), handling.py (a
request's limits and errors), endpoints.py (what chat and completions ask
for and answer), answers.py and sse.py (streaming or collecting the answer
against a client that may leave). Every error is OpenAI's error JSON with a
status that says whose fault it was; a client that goes away aborts its
request in every tier.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.services.router.auth import RequireAPIKey
from tandem.services.router.backends import BackendPool
from tandem.services.router.dispatch import DispatchError
from tandem.services.router.endpoints import OpenAIEndpoints
from tandem.services.router.frontend import Frontend, InvalidRequest
from tandem.services.router.handling import GatewayConfig, RequestHandler
from tandem.services.router.http_errors import RETRY, error_response
from tandem.services.router.openai_protocol import now
from tandem.services.router.sse import INTERNAL_ERROR
from tandem.services.router.telemetry import RouterTelemetry

__all__ = ["GatewayConfig", "create_app"]


def create_app(frontend: Frontend, telemetry: RouterTelemetry, pools: dict[str, BackendPool],
               config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="tandem", summary="OpenAI-compatible gateway of tandem")
    handle = RequestHandler(frontend, telemetry, config)
    endpoints = OpenAIEndpoints(frontend)

    app.add_middleware(RequireAPIKey, keys=config.api_keys, telemetry=telemetry)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # The /v1 routes answer their own errors (RequestHandler); only the
        # others get here. Starlette re-raises the exception after this answer
        # and uvicorn logs it with its traceback: logging it here too would log
        # it twice.
        return error_response(500, INTERNAL_ERROR)

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

    def model_object(name: str, view) -> dict:
        return {"id": name, "object": "model", "created": now(), "owned_by": "tandem",
                "max_model_len": view.max_model_len}

    @app.get("/v1/models")
    async def models():
        try:
            view = frontend.view()
        except DispatchError as exc:
            return error_response(exc.http_status, exc.message, headers=RETRY)
        return {"object": "list", "data": [model_object(n, view) for n in frontend.model_names(view)]}

    # :path, for ids with a slash (HuggingFaceTB/SmolLM2-135M-Instruct).
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if not model_id:  # check_model takes no name as "the default model"
            return error_response(404, "GET /v1/models/: give a model id (see GET /v1/models)",
                                  param="model", code="model_not_found")
        try:
            view = frontend.view()
            frontend.check_model(model_id)
        except DispatchError as exc:
            return error_response(exc.http_status, exc.message, headers=RETRY)
        except InvalidRequest as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        return model_object(model_id, view)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, frontend.prompts.chat_completion, endpoints.chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, frontend.prompts.completion, endpoints.completion)

    # vLLM's, at the root as vLLM serves them: clients that count tokens before
    # sending (or check a prompt's fit) call these.
    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle(request, frontend.prompts.tokenize, endpoints.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle(request, frontend.prompts.detokenize, endpoints.detokenize)

    return app
