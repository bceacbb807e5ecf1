"""`tandem bench admission-replay`: an offline workload through the real
scheduler without a model, counting the work each --admission policy asks."""
import json
import subprocess
import sys

from tandem.bench.admission_replay import replay


def test_greedy_recomputes_what_reserve_never_computes_twice():
    prompt_lens = [40 + (i * 37) % 200 for i in range(60)]
    output_lens = [64] * 60
    once = sum(prompt_lens) + sum(n - 1 for n in output_lens)
    greedy = replay(prompt_lens, output_lens, kv_tokens=4000, admission="greedy", max_num_seqs=64,
                    max_num_batched_tokens=2048)
    reserve = replay(prompt_lens, output_lens, kv_tokens=4000, admission="reserve", max_num_seqs=64,
                     max_num_batched_tokens=2048)
    assert greedy.preemptions > 0 and greedy.tokens_recomputed > 0
    assert greedy.tokens_computed == once + greedy.tokens_recomputed
    assert reserve.preemptions == 0 and reserve.tokens_recomputed == 0 and reserve.tokens_computed == once
    assert reserve.admissions_deferred > 0
    # Fewer requests at once: more, smaller decode steps.
    assert reserve.decode_steps > greedy.decode_steps and reserve.mean_decode_batch < greedy.mean_decode_batch
    # An overcommit sits between the two: some work twice, fuller batches than exact reserve's.
    between = replay(prompt_lens, output_lens, kv_tokens=4000, admission="reserve", max_num_seqs=64,
                     max_num_batched_tokens=2048, overcommit=0.3)
    assert 0 < between.tokens_recomputed < greedy.tokens_recomputed
    assert reserve.mean_decode_batch < between.mean_decode_batch


def test_a_bursts_short_tail_joins_the_batch_instead_of_decoding_alone_afterwards():
    # The same 60 requests over a cache a few of them short: held back, the
    # last ones decode alone once the rest finish (twice the decode steps);
    # admitted as a tail, they cost one preemption.
    prompt_lens = [40 + (i * 37) % 200 for i in range(60)]
    output_lens = [64] * 60
    once = sum(prompt_lens) + sum(n - 1 for n in output_lens)
    strict, tail = (replay(prompt_lens, output_lens, kv_tokens=12400, admission="reserve", max_num_seqs=64,
                           max_num_batched_tokens=2048, tail=share) for share in (0.0, 0.1))
    assert strict.admissions_tail == 0 and strict.admissions_deferred > 0 and strict.preemptions == 0
    assert tail.admissions_tail > 0 and tail.admissions_deferred == 0
    assert tail.decode_steps < 0.6 * strict.decode_steps
    assert 0 < tail.tokens_recomputed < 0.05 * once


def test_the_command_prints_both_policies_and_writes_json(tmp_path):
    out = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, "-m", "tandem.bench.admission_replay", "--kv-tokens", "20000",
                           "--num-prompts", "40", "--admission-overcommit", "0", "--admission-overcommit", "0.2",
                           "--output-json", str(out)],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["admission", "steps", "decode"]
    assert [line.split()[0] for line in lines[1:]] == ["reserve", "reserve", "greedy"]
    assert [line.split()[1] for line in lines[1:3]] == ["0", "0.2"]  # reserve's overcommit
    data = json.loads(out.read_text())
    assert [(r["admission"], r["overcommit"], r["tail"]) for r in data["results"]] == [
        ("reserve", 0.0, 0.1), ("reserve", 0.2, 0.1), ("greedy", None, None)]
    assert "40 prompts" in proc.stderr
