"""Tensor parallelism across GPUs (NCCL, one rank per GPU): greedy tokens
and logprobs of a TP=2 engine, and of a TP=4 one where four GPUs are,
against HF transformers in fp32 on the same GPU, eager and with decode CUDA
graphs (whose captures hold the all-reduces), with chunked prefill and a
prefix hit; and a TP=2 bf16 engine against a TP=1 one. Skipped without two
GPUs."""
from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.test_engine_gpu import hf_greedy_cuda
from tests.support.hf_oracle import compare_with_tie_rule, tiny_model_dir

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

LENGTHS = [1, 5, 17, 33, 64, 150, 300, 7]
MAX_NEW = 16


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tp_on_gpus_matches_hf(tmp_path, eager, tp):
    from tandem.engine import LLM, SamplingParams

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")

    # head_dim 16: the smallest the Triton kernels take
    path, hf = tiny_model_dir(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=128)
    hf = hf.cuda()
    ps = prompts()
    prefix_prompt = ps[6][:40] + [9, 10, 11]  # 32 tokens of prompt 6 cached by then
    llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, num_blocks=512,
              tensor_parallel_size=tp, max_num_batched_tokens=128, long_prefill_token_threshold=64,
              max_num_seqs=16)
    try:
        runner = llm.engine.runner
        assert runner.device == torch.device("cuda", 0)
        assert runner.model.model.layers[0].self_attn.num_heads == 8 // tp
        assert (runner.graphs is None) == eager
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
        outs = llm.generate(ps, params) + llm.generate([prefix_prompt], params)
        assert outs[-1].num_cached_tokens == 32
        for p, out in zip(ps + [prefix_prompt], outs):
            ref = hf_greedy_cuda(hf, p, MAX_NEW)
            c = out.outputs[0]
            n = compare_with_tie_rule(c.token_ids, [lp.top for lp in c.logprobs], ref, exact=False)
            assert [lp.logprob for lp in c.logprobs[:n]] == pytest.approx(ref.logprobs[:n], abs=1e-3)
    finally:
        llm.shutdown()


@pytest.mark.timeout(600)
def test_tp2_bf16_agrees_with_tp1(tmp_path):
    """bf16 sums in another order across ranks: most greedy tokens, not all."""
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "qwen3", num_attention_heads=8, num_key_value_heads=4)
    ps = prompts(5)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(path, device="cuda", num_blocks=512, tensor_parallel_size=tp, max_num_seqs=16)
        try:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
        finally:
            llm.shutdown()
    first_tokens = sum(a[0] == b[0] for a, b in zip(tokens[1], tokens[2]))
    assert first_tokens >= len(ps) - 1


@pytest.mark.timeout(300)
def test_peer_all_reduce_sums_as_nccl_does():
    """The one-shot peer-memory all-reduce gives NCCL's sums, bf16 and fp32,
    at sizes on both sides of where the engine switches to NCCL; fails too
    where this PyTorch offers no symmetric memory (the bench exits 1)."""
    from tandem.bench.all_reduce import main

    assert main(["--world-size", "2", "--sizes", "16,8K,96K,1M", "--replays", "5"]) == 0


KILL_SCRIPT = """
import sys, threading, time
from tandem.engine import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM({path!r}, device="cuda", tensor_parallel_size=2, peer_all_reduce={peer})
    if {kill}:
        threading.Timer(2.0, llm.engine.tp_workers.procs[0].kill).start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=500, ignore_eos=True))
        print("NOT RAISED", flush=True)
    except RuntimeError as exc:
        print(f"RAISED after {{time.monotonic() - start:.1f}} s: {{exc}}", flush=True)
    llm.shutdown()
    print("SHUT DOWN", flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["killed", "exits-inside-a-step"])
@pytest.mark.parametrize("nccl_only", [False, True], ids=["peer-all-reduce", "nccl"])
def test_a_rank_lost_mid_generation_fails_the_step_by_name(tmp_path, nccl_only, how):
    """NCCL's collectives wait for ever on a dead peer: rank 0's watcher
    aborts them so the step fails naming the worker; where a kernel waits on
    peer memory, which no abort reaches, the process ends itself instead.
    killed: SIGKILL at any moment (mostly caught writing the next plan);
    exits-inside-a-step: the worker takes its 300th plan and exits without
    running it, which leaves rank 0 inside that step's collectives."""
    import os
    import subprocess
    import sys

    path, _ = tiny_model_dir(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=128)
    script = tmp_path / "lose_a_rank.py"
    script.write_text(KILL_SCRIPT.format(path=path, peer=not nccl_only, kill=how == "killed"))
    env = dict(os.environ)
    if how != "killed":
        env["TANDEM_FAULT_TP_WORKER_EXIT_AT_PLAN"] = "300"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env)
    print(proc.stdout, proc.stderr[-3000:])
    code = -9 if how == "killed" else 99
    assert f"tandem-tp-rank1 exited with code {code}" in proc.stdout + proc.stderr
    assert "RAISED" in proc.stdout and "the engine cannot step" in proc.stdout
    # Then either shut down, or (the GPU stuck in a peer-memory wait) ended itself.
    if proc.returncode == 70:
        assert "exiting this process" in proc.stderr
    else:
        assert "SHUT DOWN" in proc.stdout
