"""`tandem bench spec-decode`'s rounds and steady mode, on a tiny random
model of SmolLM2's vocabulary on the CPU: every setting runs every round,
the speed-ups are taken per round, and steady mode counts tokens only while
the batch is full."""
from __future__ import annotations

import json

from tandem.bench import spec_decode
from tests.support.hf_oracle import tiny_model_dir

# The SpecResult fields the JSON gives back as they were (the breakdowns are left out).
FIELDS = {"setting", "batch_size", "output_tokens", "decode_tokens", "seconds", "decode_seconds", "draft_tokens",
          "accepted_tokens", "drafts", "emitted_tokens", "same_as_baseline", "round"}


def test_rounds_and_steady_batches(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama", vocab_size=49152)
    out = tmp_path / "spec.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    assert spec_decode.main(["--model", path, "--tokenizer", "smollm2", "--device", "cpu", "--dtype", "float32",
                             "--batch-sizes", "2", "--max-tokens", "8", "--rounds", "2", "--steady",
                             "--workload", "open", "--speculative-config", spec,
                             "--output-json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert sorted((r["setting"], r["round"]) for r in results) == [("S1", 0), ("S1", 1), ("none", 0), ("none", 1)]
    for r in results:
        # 8 requests of up to 8 tokens, counted while 2 run: more than none, fewer than all.
        assert 0 < r["decode_tokens"] < r["output_tokens"] <= 64
        assert r["decode_seconds"] > 0
    adaptive = [r for r in results if r["setting"] == "S1"]
    assert all(r["speculating_share"] is not None for r in adaptive), "the governor's share is reported"
    ups = spec_decode.speedups([spec_decode.SpecResult(**{k: v for k, v in r.items() if k in FIELDS})
                                for r in results])
    assert len(ups[("S1", 2)]) == 2 and ("none", 2) in ups
