"""The prefill role: a gRPC server around an engine that runs each prompt,
samples its first token and saves the prompt's full KV blocks to the KV store
(--kv-transfer store --kv-store HOST:PORT), or keeps them in its shared cache
for the decode to copy (--kv-transfer direct; the reply's kv_handle says
where, ReleaseKV lets them go).

Its connector both saves and loads (kv_role "both"): blocks of a prompt
prefix that another prefill instance already computed come from the store,
so the store is a prefix cache shared by the whole prefill tier.

    python -m tandem.services.prefill.server --kv-transfer store --kv-store 127.0.0.1:50081
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
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

ROLE = "prefill"


class PrefillServicer(EngineServicer, prefill_pb2_grpc.PrefillServiceServicer):
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        from tandem.engine import SamplingParamsError

        p = request.params
        try:
            # Exactly one token, sampled with the request's own parameters. A
            # min_tokens above 1 still forbids EOS for this first token.
            params = sampling_params_from_proto(p, n=1, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        except SamplingParamsError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt_token_ids: must contain at least one token")
        await self.refuse_if_dead(context)
        async with self.admission.admit(context):
            return await self._prefill(request, params, context)

    async def _prefill(self, request: prefill_pb2.PrefillRequest, params, context):
        timer = self.metrics.start_request()
        reply = prefill_pb2.PrefillResponse()
        last = None
        async with self.running(context, timer, len(request.prompt_token_ids)):
            # Cancelling this handler (the router's call cancelled) closes the
            # generator, which aborts the request in the engine.
            async for out in self.engine.generate(request.request_id, list(request.prompt_token_ids),
                                                  params):
                last = out
                if out.new_logprobs:
                    reply.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        if last is None or not last.new_token_ids or not last.finished or last.finish_reason == "abort":
            await context.abort(grpc.StatusCode.ABORTED, f"request {request.request_id} was aborted")
        self.metrics.on_tokens(timer, 1)
        self.metrics.finish_request(timer, last.finish_reason, last.num_prompt_tokens)
        # Token ids only: the decode engine turns them into text and applies
        # the stop rules, so the text equals a colocated engine's.
        reply.first_token_id = last.new_token_ids[0]
        reply.num_prompt_tokens = last.num_prompt_tokens
        reply.num_cached_tokens = last.num_cached_tokens
        reply.num_external_tokens = last.num_external_tokens
        from tandem.services.common.kv_handle import handle_to_proto, store_write_to_proto  # torch: when serving

        handle = handle_to_proto(last.kv_transfer_params)
        if handle is not None:
            reply.kv_handle.CopyFrom(handle)
        write = store_write_to_proto(last.kv_transfer_params)
        if write is not None:  # answered before the store has every block
            reply.kv_store_write.CopyFrom(write)
        return reply

    async def ReleaseKV(self, request: prefill_pb2.ReleaseKVRequest, context) -> prefill_pb2.ReleaseKVResponse:
        # The engine thread frees the blocks; the reply does not wait for it.
        self.engine.release_kv(request.request_id)
        return prefill_pb2.ReleaseKVResponse(released=True)


def _add_servicers(server: grpc.aio.Server, engine, metrics: EngineMetrics,
                   admission: Admission) -> list[str]:
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(engine, metrics, admission), server)
    return [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_role_arguments(parser, role=ROLE, default_port=50061, default_metrics_port=9061)


def serve(args: argparse.Namespace) -> int:
    return asyncio.run(run_engine_service(args, role=ROLE, kv_role="both",
                                          add_servicers=_add_servicers))


def main() -> None:
    run_main(add_arguments, serve, "tandem prefill service: runs prompts and saves their KV blocks.")


if __name__ == "__main__":
    main()
