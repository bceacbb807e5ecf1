"""A request for n choices is n single-choice requests, seeded seed+i
(wrapped within int64): written once, in SamplingParams.choices, and used
by the offline LLM and by the router alike."""
from __future__ import annotations

import asyncio

from tandem.engine.request import INT64_MAX, INT64_MIN, SamplingParams
from tandem.services.router.dispatch import Delta
from tandem.v1 import common_pb2


def test_n_choices_are_n_single_choice_params_with_consecutive_seeds():
    params = SamplingParams(n=3, seed=INT64_MAX - 1, temperature=0.7, stop=["x"], max_tokens=5)
    choices = params.choices()
    assert [c.n for c in choices] == [1, 1, 1]
    assert [c.seed for c in choices] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]
    assert all((c.temperature, c.stop, c.max_tokens) == (0.7, ["x"], 5) for c in choices)
    assert params.n == 3 and params.seed == INT64_MAX - 1  # the request's own params are untouched


def test_unseeded_choices_stay_unseeded():
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]


class _RecordingDispatcher:
    def __init__(self) -> None:
        self.sent: list[tuple[str, common_pb2.SamplingParams]] = []

    async def generate(self, request_id, prompt, params):
        self.sent.append((request_id, params))
        yield Delta(token_ids=[1], text="a", finish_reason="stop", num_output_tokens=1)


def test_the_router_sends_each_choice_with_the_engines_choice_params():
    from tandem.services.router.engine_reports import EngineReports
    from tandem.services.router.frontend import Frontend, ServedModel

    class Tokenizer:
        def __len__(self) -> int:
            return 100

    dispatcher = _RecordingDispatcher()
    frontend = Frontend(ServedModel("m", tokenizer=Tokenizer()), dispatcher, prompts=None,
                        reports=EngineReports("m"))
    wire = common_pb2.SamplingParams(n=2, seed=INT64_MAX, temperature=0.5, max_tokens=4)
    params = frontend.finalize_params(3, wire, max_model_len=64)

    async def run() -> list[int]:
        return [index async for index, _ in frontend.generate("req", [1, 2, 3], params)]

    assert sorted(asyncio.run(run())) == [0, 1]
    assert [rid for rid, _ in dispatcher.sent] == ["req-0", "req-1"]
    assert [(p.n, p.seed) for _, p in dispatcher.sent] == [(1, INT64_MAX), (1, INT64_MIN)]
    assert all(p.temperature == 0.5 and p.max_tokens == 4 for _, p in dispatcher.sent)
