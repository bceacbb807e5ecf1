"""The decode role: a gRPC server around an engine that takes a request with
the first token prefill sampled, loads the prompt's KV blocks it lacks from
the KV store (--kv-transfer store, connector role "consumer") or copies them
from the prefill's shared cache (--kv-transfer direct and the request's
kv_handle), recomputing them when neither can provide them, and streams the
rest of the answer.

    python -m tandem.services.decode.server --kv-transfer store --kv-store 127.0.0.1:50081
"""
from __future__ import annotations

import argparse
import asyncio

import grpc

from tandem.services.common.config import run_main
from tandem.services.common.engine_metrics import EngineMetrics
from tandem.services.common.engine_process import add_engine_role_arguments, run_engine_service
from tandem.services.common.proto_convert import logprob_to_proto, sampling_params_from_proto
from tandem.services.common.role_servicer import Admission, EngineServicer
from tandem.v1 import decode_pb2, decode_pb2_grpc

ROLE = "decode"


class DecodeServicer(EngineServicer, decode_pb2_grpc.DecodeServiceServicer):
    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        from tandem.engine import SamplingParamsError

        try:
            params = sampling_params_from_proto(request.params, n=1)
        except SamplingParamsError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt_token_ids: must contain at least one token")
        from tandem.services.common.kv_handle import handle_from_proto, store_write_from_proto  # torch: when serving

        kv_transfer_params = None
        if request.HasField("kv_handle"):
            try:
                kv_transfer_params = handle_from_proto(request.kv_handle)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.HasField("kv_store_write"):
            try:
                write = store_write_from_proto(request.kv_store_write, len(request.prompt_token_ids))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            kv_transfer_params = {**(kv_transfer_params or {}), **write} or None
        await self.refuse_if_dead(context)
        async with self.admission.admit(context):
            async for reply in self._decode(request, params, kv_transfer_params, context):
                yield reply

    async def _decode(self, request: decode_pb2.DecodeRequest, params, kv_transfer_params, context):
        # Tokens prefill sampled: this engine detokenizes them and applies the
        # stop rules to them; its first message carries them with their text.
        first = list(request.first_token_ids) or None
        timer = self.metrics.start_request()
        last = None
        async with self.running(context, timer, len(request.prompt_token_ids)):
            # Cancelling this handler (the router's call cancelled) closes the
            # generator, which aborts the request in the engine.
            async for out in self.engine.generate(request.request_id, list(request.prompt_token_ids),
                                                  params, first_token_ids=first,
                                                  kv_transfer_params=kv_transfer_params):
                # Tokens prefill sampled (in the first output) were counted as generated there.
                generated = len(out.new_token_ids) - (len(first or ()) if last is None else 0)
                last = out
                self.metrics.on_tokens(timer, generated)
                yield decode_pb2.DecodeResponse(
                    token_ids=out.new_token_ids, text=out.new_text,
                    logprobs=[logprob_to_proto(lp) for lp in out.new_logprobs],
                    finish_reason=(out.finish_reason or "") if out.finished else "",
                    num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    num_external_tokens=out.num_external_tokens)
        if last is not None and last.finished:
            self.metrics.finish_request(timer, last.finish_reason, last.num_prompt_tokens)


def _add_servicers(server: grpc.aio.Server, engine, metrics: EngineMetrics,
                   admission: Admission) -> list[str]:
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine, metrics, admission), server)
    return [decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_role_arguments(parser, role=ROLE, default_port=50071, default_metrics_port=9071)


def serve(args: argparse.Namespace) -> int:
    return asyncio.run(run_engine_service(args, role=ROLE, kv_role="consumer",
                                          add_servicers=_add_servicers))


def main() -> None:
    run_main(add_arguments, serve, "tandem decode service: loads KV blocks and streams answers.")


if __name__ == "__main__":
    main()
