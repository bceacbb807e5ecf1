"""A sweep must not re-send prompts a server's prefix cache still holds: the
warm-up request has words of its own, and --seed-per-rate gives every rate new
prompts (the same ones for every deployment)."""
from __future__ import annotations

from tandem.bench import sweep
from tandem.bench.cli import main as bench_main
from tandem.bench.datasets import DatasetConfig, generate
from tandem.bench.metrics import summarize
from tandem.bench.serve import ServeResult, warmup_request


def test_warmup_request_shares_no_prompt_with_the_measured_one():
    like = generate(DatasetConfig(name="random", num_prompts=1, input_len=200))[0]
    warm = warmup_request(like, 0)
    assert warm.prompt_len == like.prompt_len and warm.output_len <= 16
    assert warm.prompt_text() != like.prompt_text()
    assert warm.prompt_text().split()[:16] != like.prompt_text().split()[:16]  # not even a first block


def _sent_prompts(monkeypatch, tmp_path, *flags) -> dict[tuple[str, float], list[str]]:
    sent: dict[tuple[str, float], list[str]] = {}

    def fake_run_serve(config, requests):
        sent[(config.endpoint.base_url, config.load.request_rate)] = [r.prompt_text() for r in requests]
        return ServeResult(config, [], summarize([], 1.0, config.slos_ms))

    monkeypatch.setattr(sweep, "run_serve", fake_run_serve)
    bench_main(["bench", "sweep", "--target", "a=http://127.0.0.1:1/v1", "--target", "b=http://127.0.0.1:2/v1",
                "--request-rates", "1,2", "--num-prompts", "3", "--model", "m", "--disable-tqdm",
                "--result-dir", str(tmp_path), *flags])
    return sent


def test_seed_per_rate_sends_new_prompts_at_every_rate_and_the_same_to_every_target(monkeypatch, tmp_path):
    sent = _sent_prompts(monkeypatch, tmp_path, "--seed-per-rate")
    a1, a2 = sent[("http://127.0.0.1:1/v1", 1.0)], sent[("http://127.0.0.1:1/v1", 2.0)]
    assert not set(a1) & set(a2)
    assert sent[("http://127.0.0.1:2/v1", 1.0)] == a1 and sent[("http://127.0.0.1:2/v1", 2.0)] == a2


def test_without_seed_per_rate_every_rate_sends_the_same_prompts(monkeypatch, tmp_path):
    sent = _sent_prompts(monkeypatch, tmp_path)
    assert sent[("http://127.0.0.1:1/v1", 1.0)] == sent[("http://127.0.0.1:1/v1", 2.0)]
