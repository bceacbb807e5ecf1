"""The engine's side of structured outputs: each constrained request's
grammar is compiled on a thread beside the step loop, and the request enters
the scheduler only once its matcher is ready (vLLM's "waiting for FSM").
Each step, the bitmasks of every constrained request in the batch are filled
in one native call and applied to the logits before sampling; each sampled
token then advances its request's matcher.

A request that arrives with tokens already sampled (a decode after the
prefill's first token) has its matcher advanced over them before its first
step, so the grammar state survives the prefill -> decode handoff without
travelling: both sides rebuild it from the same request.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from tandem.engine.grammar import GrammarBackend, TokenMasks, allocate_bitmask
from tandem.engine.request import Request, RequestFailedError
from tandem.engine.structured_outputs import StructuredOutputsError

log = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend], vocab_size: int,
                 pin_memory: bool = False) -> None:
        # The backend (a vocabulary index, ~0.1 s) is built on the compile
        # thread with the first constrained request: engines that never see
        # one never pay for it.
        self._make_backend = make_backend
        self._backend: Optional[GrammarBackend] = None
        self.vocab_size = vocab_size
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._pending: dict[str, tuple[Request, Future]] = {}
        self._pin = pin_memory
        # Sampled tokens not yet taken by their matchers (accept()), and the
        # requests whose matcher refused one.
        self._pending_tokens: list[tuple[Request, int]] = []
        self._refused: set[Request] = set()
        self._bitmask = allocate_bitmask(0, vocab_size)
        # True from the first constrained request on: until then a step does
        # not even look for grammars in its batch.
        self.in_use = False

    # ---- requests waiting for their grammar ---------------------------
    def submit(self, request: Request) -> None:
        spec = request.params.structured_outputs
        self.in_use = True
        self._pending[request.request_id] = (request, self._compiler.submit(self._compile, spec))

    def _compile(self, spec) -> Any:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend.compile(spec)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pending_requests(self) -> list[Request]:
        return [r for r, _ in self._pending.values()]

    def abort(self, request_id: str) -> Optional[Request]:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return None
        entry[1].cancel()
        return entry[0]

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, RequestFailedError]]]:
        """Requests whose grammar is compiled, each with its matcher set and
        advanced over the tokens it already has; and those whose grammar or
        first tokens failed, with why."""
        ready: list[Request] = []
        failed: list[tuple[Request, RequestFailedError]] = []
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            try:
                request.grammar = self._matcher(request, future.result())
            except StructuredOutputsError as exc:
                failed.append((request, RequestFailedError(str(exc), field=str(exc).split(":", 1)[0])))
                continue
            except Exception as exc:
                log.exception("compiling the grammar of request %s failed", rid)
                failed.append((request, RequestFailedError(
                    f"{request.params.structured_outputs.field_name}: the grammar could not be "
                    f"compiled: {exc}", field=request.params.structured_outputs.field_name)))
                continue
            ready.append(request)
        return ready, failed

    def _matcher(self, request: Request, compiled: Any):
        matcher = self._backend.matcher(compiled)
        for i, token in enumerate(request.output_token_ids):
            if not matcher.accept_token(token):
                name = request.params.structured_outputs.field_name
                raise StructuredOutputsError(
                    f"{name}: output token {i} ({token}), sampled before this engine took the "
                    "request, does not follow the grammar")
        return matcher

    # ---- each step ------------------------------------------------------
    def bitmask(self, requests: Sequence[Request]) -> Optional[TokenMasks]:
        """The grammar masks of this batch's constrained requests (bitmask
        rows aligned with the batch), or None when it has none. The engine
        calls it once the step's forward is launched: on a GPU the matchers'
        work (the last step's tokens accepted, the masks filled) runs while
        the model does."""
        self._accept_pending()
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = allocate_bitmask(max(len(requests), 2 * self._bitmask.shape[0]), self.vocab_size,
                                             pin=self._pin)
        bitmask = self._bitmask[: len(requests)]
        self._backend.fill_bitmasks([requests[i].grammar for i in rows], bitmask, rows)
        for i in rows:
            if requests[i] in self._refused:
                # Its matcher refused a token (the mask should have made that
                # impossible): no token is allowed, so the sampler fails it.
                bitmask[i] = 0
        return TokenMasks(bitmask, rows)

    def accept(self, requests: Sequence[Request], token_ids: Sequence[int],
               errors: dict[int, RequestFailedError]) -> None:
        """Note each constrained request's sampled token; the matchers take
        them at the next bitmask(), in one native call, off the critical
        path between this step's sampling and the next step's launch."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and i not in errors]
        self._pending_tokens.extend((requests[i], token_ids[i]) for i in rows)

    def _accept_pending(self) -> None:
        pending = [(r, t) for r, t in self._pending_tokens if not r.is_finished]
        self._pending_tokens = []
        self._refused = {r for r in self._refused if not r.is_finished}
        if not pending:
            return
        accepted = self._backend.accept_tokens([r.grammar for r, _ in pending], [t for _, t in pending])
        for (request, token), ok in zip(pending, accepted):
            if not ok:
                log.error("request %s: the grammar refused sampled token %d", request.request_id, token)
                self._refused.add(request)

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
