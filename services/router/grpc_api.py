"""The public gRPC API (tandem.v1.TandemService), served by the router next to
its HTTP gateway and sharing its frontend: same tokenization, validation,
routing and metrics."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from tandem.services.router.auth import bearer_token, key_matches
from tandem.services.router.dispatch import DispatchError
from tandem.services.router.frontend import Frontend, InvalidRequest, new_request_id
from tandem.services.router.telemetry import RouterTelemetry
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)


class TandemServicer(generate_pb2_grpc.TandemServiceServicer):
    def __init__(self, frontend: Frontend, telemetry: RouterTelemetry, api_keys: list[str],
                 max_in_flight: int = 1024) -> None:
        self.frontend = frontend
        self.telemetry = telemetry
        self.api_keys = [k.encode() for k in api_keys]
        self.max_in_flight = max_in_flight

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if not self.api_keys:
            return True
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        return key_matches(bearer_token(given.encode()), self.api_keys)

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self._authorized(context):
            self.telemetry.refused("UNAUTHENTICATED")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata 'authorization: Bearer <key>'")
        if self.telemetry.in_flight >= self.max_in_flight:
            self.telemetry.refused("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "the router is at its limit of requests in flight; retry shortly")
        clock = self.telemetry.start()
        status = grpc.StatusCode.OK
        try:
            view = self.frontend.view()
            self.frontend.check_model(request.model)
            # Templated and tokenized in the PromptPool, off the event loop; the
            # worker parses the input from the bytes itself.
            prompt = await self.frontend.prompts.generate(request.SerializeToString(), view.max_model_len)
            params = common_pb2.SamplingParams()
            params.CopyFrom(request.params)
            params = self.frontend.finalize_params(len(prompt), params, view.max_model_len)
            # Unique even when clients reuse ids: the engines key requests by it.
            request_id = new_request_id(request.request_id[:64] or "gen")
            # aclosing: a client that cancels must cancel the downstream calls
            # now, not when the generator is garbage-collected.
            async with contextlib.aclosing(self.frontend.generate(request_id, prompt, params)) as stream:
                async for index, d in stream:
                    clock.on_tokens(len(d.token_ids))
                    reply = generate_pb2.GenerateResponse(
                        index=index, token_ids=d.token_ids, text=d.text, logprobs=d.logprobs,
                        finish_reason=d.finish_reason or "")
                    if d.finish_reason:
                        reply.usage.CopyFrom(common_pb2.Usage(
                            prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_output_tokens,
                            cached_tokens=d.num_cached_tokens))
                    yield reply
        except InvalidRequest as exc:
            status = grpc.StatusCode.NOT_FOUND if exc.status == 404 else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(status, exc.message)
        except DispatchError as exc:
            status = exc.code
            await context.abort(exc.code, exc.message)
        except (asyncio.CancelledError, GeneratorExit):
            # A client that cancels while this generator waits downstream raises
            # CancelledError here; one that cancels while it sits at `yield`
            # leaves it to be closed later, which raises GeneratorExit.
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            # Logged once, here; the client gets a status, not the exception's text.
            log.exception("Generate failed")
            status = grpc.StatusCode.INTERNAL
            await context.abort(status, "internal error in the router; see its log")
        finally:
            clock.finish(status.name)

    async def ListModels(self, request: generate_pb2.ListModelsRequest, context) -> generate_pb2.ListModelsResponse:
        if not self._authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata 'authorization: Bearer <key>'")
        try:
            view = self.frontend.view()
        except DispatchError as exc:
            await context.abort(exc.code, exc.message)
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelCard(id=name, max_model_len=view.max_model_len)
                    for name in self.frontend.model_names(view)])


def add_tandem_service(server: grpc.aio.Server, servicer: TandemServicer) -> list[str]:
    generate_pb2_grpc.add_TandemServiceServicer_to_server(servicer, server)
    return [generate_pb2.DESCRIPTOR.services_by_name["TandemService"].full_name]
