"""Beam search through a real stack (`tandem up`: kvstore, prefill, decode,
router as processes; the shared default stack of test_gateway.py): the
router's search over single-token requests returns the same beams as the
offline LLM.beam_search (itself checked against HF transformers in
tests/unit/test_beam_search.py)."""
from __future__ import annotations

import json

import httpx
import pytest

from tandem.engine import LLM, BeamSearchParams
from tests.support.stack import tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = 8
# One prompt under --prefill-threshold (32 tokens: decode prefills it), one
# over it (through the prefill tier).
PROMPTS = ["The capital of France is",
           "A short story. Once upon a time, in a small village at the foot of a tall mountain, "
           "there lived an old baker who every morning, long before the sun rose over the fields,"]


def test_beam_search_completions_match_the_offline_engine(tandem_stack):
    offline = LLM("smollm2")
    assert len(offline.encode(PROMPTS[0])) < 32 <= len(offline.encode(PROMPTS[1]))
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.8)
    expected = offline.beam_search(PROMPTS, params)

    body = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "use_beam_search": True, "n": 2, "best_of": 4,
            "length_penalty": 0.8, "temperature": 0}
    r = httpx.post(f"{tandem_stack.http_url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    answer = r.json()
    choices = answer["choices"]
    # Prompt p's beam b is choice p*n + b, best first.
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for p, out in enumerate(expected):
        for b in range(2):
            beam, choice = out.sequences[b], choices[p * 2 + b]
            assert choice["text"] == beam.text, (p, b)
            assert choice["finish_reason"] == beam.finish_reason
    assert answer["usage"]["completion_tokens"] == sum(len(o.sequences[b].token_ids)
                                                       for o in expected for b in range(2))

    # Streamed: the same best beam, as one chunk once the search is done.
    del body["best_of"]
    body.update(prompt=PROMPTS[1], n=1, stream=True)
    text = ""
    with httpx.stream("POST", f"{tandem_stack.http_url}/v1/completions", json=body, timeout=600) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
    # Without best_of the width is n, here 1.
    greedy = offline.beam_search(PROMPTS[1], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS,
                                                              length_penalty=0.8))[0]
    assert text == greedy.sequences[0].text
