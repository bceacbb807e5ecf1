"""What the prefill and decode servicers share: the engine, metrics and
admission behind each call, the mapping of engine errors to gRPC codes, and
the Abort and GetLoad calls."""
from __future__ import annotations

import asyncio
import contextlib

import grpc

from tandem.services.common.engine_metrics import EngineMetrics, RequestTimer
from tandem.services.common.engine_protocol import ADMITTED_METADATA
from tandem.services.common.proto_convert import load_from_stats
from tandem.v1 import common_pb2


class EngineServicer:
    """What the prefill and decode servicers share: their engine, metrics and
    admission, the mapping of engine errors to gRPC codes, and the Abort and
    GetLoad calls. Listed first among a servicer's bases, so these methods
    replace the generated UNIMPLEMENTED ones."""

    def __init__(self, engine, metrics: EngineMetrics, admission: Admission) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admission = admission

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        await self.engine.abort(request.request_id)
        return common_pb2.AbortResponse()

    async def GetLoad(self, request: common_pb2.LoadRequest, context) -> common_pb2.Load:
        return load_from_stats(self.engine, self.engine.stats())

    async def refuse_if_dead(self, context) -> None:
        """Before admission: a dead engine says UNAVAILABLE, which the router
        may retry elsewhere (the request never reached it)."""
        if not self.engine.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this instance's engine has stopped ({self.engine.error!r}); it is "
                                "restarting")

    @contextlib.asynccontextmanager
    async def running(self, context, timer: RequestTimer, num_prompt_tokens: int):
        """Around one admitted request: tells the caller it was admitted, turns
        engine errors into gRPC statuses, and counts a request whose caller
        left as finished with reason "abort"."""
        from tandem.engine import EngineDeadError, RequestFailedError, SamplingParamsError

        await context.send_initial_metadata(ADMITTED_METADATA)
        try:
            yield
        except SamplingParamsError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailedError as exc:
            self.metrics.finish_request(timer, "error", num_prompt_tokens)
            code = grpc.StatusCode.INVALID_ARGUMENT if exc.caused_by_request else grpc.StatusCode.INTERNAL
            await context.abort(code, str(exc))
        except EngineDeadError as exc:
            self.metrics.finish_request(timer, "error", num_prompt_tokens)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"this instance's engine failed while running the request ({exc}); "
                                "retry shortly")
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away (client disconnect, router abort).
            self.metrics.finish_request(timer, "abort", num_prompt_tokens)
            raise


class Admission:
    """Bounds the requests one instance holds (running plus queued) so a burst
    is refused at the door with RESOURCE_EXHAUSTED instead of growing the
    engine's queue, and its memory, without limit."""

    def __init__(self, limit: int, metrics: EngineMetrics) -> None:
        self.limit = limit
        self.in_flight = 0
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def admit(self, context):
        if self.in_flight >= self.limit:
            self._metrics.rejected()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this instance holds {self.in_flight} requests, its limit (--max-num-seqs + "
                "--max-queued-requests); retry shortly or on another instance")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
