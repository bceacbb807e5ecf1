"""Sampling a batch where its logits are (engine/device_sampling.py, what a
GPU engine runs) against the CPU's row-by-row sampler (engine/sampler.py),
its oracle. The batched code is plain torch, so it runs here on CPU tensors:
the same distributions after every filter, the same greedy tokens, logprobs
and per-request errors, and draws that follow the distribution."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.engine import device_sampling
from tandem.engine.request import Request, SamplingParams
from tandem.engine.sampler import Sampler

VOCAB = 64
EOS = 1
# Here the CPU; on a GPU machine the same checks run where the engine uses them.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def request(i: int, **params) -> Request:
    r = Request(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=16, **params), eos_token_id=EOS)
    r.output_token_ids.extend([9, 9, 10 + i])  # some history for the penalties
    r.all_token_ids.extend([9, 9, 10 + i])
    return r


MIXED = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.1, "top_k": 20, "top_p": 0.8, "min_p": 0.01},
    {"temperature": 2.0, "top_k": 1},
    {"temperature": 1.0, "top_k": VOCAB + 5},  # larger than the vocabulary: no filter
]


@pytest.mark.parametrize("device", DEVICES)
def test_every_filter_gives_the_rows_distribution_of_the_cpu_sampler(device):
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), VOCAB) * 3
    requests = [request(i, **p) for i, p in enumerate(MIXED)]
    batched = device_sampling.filtered_probs(logits.to(device), requests).cpu()
    for i, r in enumerate(requests):
        assert torch.allclose(batched[i], Sampler.filtered_probs(logits[i].clone(), r), atol=1e-6), MIXED[i]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_logprobs_and_what_precedes_the_draw_match_the_cpu_sampler(device):
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB) * 2
    requests = [request(0, temperature=0.0),
                request(1, temperature=0.0, logit_bias={3: 40.0}),
                request(2, temperature=0.0, repetition_penalty=1.8, logprobs=3),
                request(3, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
                request(4, temperature=0.0, min_tokens=10, stop_token_ids=[int(logits[4].argmax())]),
                request(5, temperature=0.0, logprobs=0)]
    ours = device_sampling.sample(logits.to(device), requests, VOCAB)
    cpu = Sampler(VOCAB)(logits.clone(), requests)
    assert ours.token_ids == cpu.token_ids and ours.token_ids[1] == 3 and not ours.errors
    for a, b in zip(ours.logprobs, cpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert a.top.keys() == b.top.keys()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_cannot_be_drawn_fail_alone_with_the_cpu_samplers_errors(device):
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = float("nan")
    requests = [request(0, temperature=1.0, seed=3),
                request(1, temperature=1.0),
                # every token banned while min_tokens holds
                request(2, temperature=1.0, min_tokens=10, stop_token_ids=[0, *range(2, VOCAB)])]
    ours = device_sampling.sample(logits.to(device), requests, VOCAB)
    cpu = Sampler(VOCAB)(logits.clone(), requests)
    assert sorted(ours.errors) == sorted(cpu.errors) == [1, 2]
    assert all(str(ours.errors[i]) == str(cpu.errors[i]) for i in (1, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_distribution_and_seeds_repeat(device):
    torch.manual_seed(2)
    rows = 4000
    row = torch.randn(VOCAB, device=device)
    requests = [request(i, temperature=0.8, top_p=0.9) for i in range(rows)]
    result = device_sampling.sample(row.expand(rows, VOCAB).clone(), requests, VOCAB)
    expected = device_sampling.filtered_probs(row.unsqueeze(0), requests[:1])[0].cpu()
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=VOCAB).float()
    assert counts[expected == 0].sum() == 0  # nothing outside top-p
    kept = expected > 0
    # Pearson's chi-square over the kept tokens, against a bound no fair draw
    # exceeds but once in about 10^5 runs at these degrees of freedom.
    observed, wanted = counts[kept], expected[kept] * rows
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 8 * math.sqrt(2 * dof) + 10, (chi2, dof)

    def seeded(seed: int) -> list[int]:
        reqs = [request(i, temperature=1.0, seed=seed + i) for i in range(8)]
        return device_sampling.sample(row.expand(8, VOCAB).clone(), reqs, VOCAB).token_ids

    assert seeded(11) == seeded(11) and seeded(11) != seeded(12)
