"""Tensor parallelism on the CPU (engine/tensor_parallel.py, tp_workers.py):
real rank processes joined over gloo, each holding its shard of the heads,
KV heads, MLP channels and vocabulary; greedy output must be HF
transformers' for a batch of eight prompts of mixed lengths, with chunked
prefill and a prefix-cache hit, on tiny Llama and Qwen3 models with 8 heads
(TP=2) and on the real SmolLM2 (9 heads, 3 KV heads: TP=3)."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.config import ConfigError, EngineArgs
from tests.support.hf_oracle import check_against_oracle, hf_greedy, run_greedy, tiny_model_dir

LENGTHS = [1, 5, 17, 33, 64, 150, 7, 90]
MAX_NEW = 12


# Each case starts rank processes (seconds each): Llama without chunks, Qwen3 in chunks
# with asynchronous scheduling (the workers read rank 0's sampled tokens from a broadcast).
CASES = {"llama": {"async_scheduling": "off"},
         "qwen3": {"max_num_batched_tokens": 40, "long_prefill_token_threshold": 24, "async_scheduling": "on"}}


@pytest.fixture(scope="module", params=list(CASES), ids=["llama-plain", "qwen3-chunked-async"])
def tiny8(request, tmp_path_factory):
    path, hf = tiny_model_dir(tmp_path_factory.mktemp("tp"), request.param, num_attention_heads=8,
                              num_key_value_heads=4)
    rng = random.Random(7)
    prefix = [rng.randrange(2, 512) for _ in range(40)]  # two full blocks and a part
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    prompts += [prefix + [rng.randrange(2, 512) for _ in range(5)]]
    refs = [hf_greedy(hf, p, MAX_NEW, eos_token_id=None) for p in prompts]
    prefix_prompt = prefix + [rng.randrange(2, 512) for _ in range(9)]
    return {"path": path, "options": CASES[request.param], "prompts": prompts, "refs": refs,
            "prefix_prompt": prefix_prompt,
            "prefix_ref": hf_greedy(hf, prefix_prompt, MAX_NEW, eos_token_id=None)}


@pytest.mark.timeout(300)
def test_tp2_tiny_models_match_hf(tiny8):
    llm = LLM(tiny8["path"], tensor_parallel_size=2, **tiny8["options"])
    try:
        workers = llm.engine.tp_workers.procs
        assert len(workers) == 1 and workers[0].is_alive()  # rank 1 is a process of its own
        runner = llm.engine.runner
        layer = runner.model.model.layers[0]
        assert layer.self_attn.num_heads == 4 and layer.self_attn.num_kv_heads == 2  # half of 8 and 4
        assert runner.layout.num_kv_heads == 2
        assert llm.engine.async_scheduling == (tiny8["options"]["async_scheduling"] == "on")
        check_against_oracle(run_greedy(llm, tiny8["prompts"], MAX_NEW), tiny8["refs"], exact=False)
        # the last prompt's first 32 tokens are cached now: this one starts from a prefix hit
        outs = run_greedy(llm, [tiny8["prefix_prompt"]], MAX_NEW)
        assert outs[0].num_cached_tokens == 32
        check_against_oracle(outs, [tiny8["prefix_ref"]], exact=False)
    finally:
        llm.shutdown()
    for p in workers:
        p.join(10)
        assert not p.is_alive()


@pytest.mark.timeout(300)
def test_tp3_smollm2_matches_hf():
    from tests.support.hf_oracle import embedded_hf_model

    hf, tok = embedded_hf_model()
    prompts = [tok(t)["input_ids"] for t in ("The capital of France is", "Water boils at",
                                              "def fibonacci(n):", "Once upon a time, in a quiet village,")]
    refs = [hf_greedy(hf, p, 16, eos_token_id=None) for p in prompts]
    del hf
    llm = LLM("smollm2", tensor_parallel_size=3, num_blocks=256)
    try:
        assert llm.engine.runner.model.model.layers[0].self_attn.num_heads == 3  # 9 heads / 3
        check_against_oracle(run_greedy(llm, prompts, 16), refs, exact=False)
    finally:
        llm.shutdown()


def test_tensor_parallel_refuses_what_it_is_not_built_for(tmp_path):
    with pytest.raises(ConfigError, match="does not work with --kv-transfer nixl"):
        EngineArgs(tensor_parallel_size=2, kv_transfer="nixl").create_engine_config()
    path, _ = tiny_model_dir(tmp_path, "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    # One rank per GPU: fewer visible GPUs than ranks (none here) is refused before any rank starts.
    visible = torch.cuda.device_count()
    if visible < 2:
        with pytest.raises(ConfigError, match=rf"runs one rank per GPU and this process sees {visible} GPU"):
            LLM(path, tensor_parallel_size=2, device="cuda")


@pytest.mark.timeout(120)
def test_a_dead_rank_fails_the_step_instead_of_hanging(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")  # 4 heads, 2 KV heads: TP=2
    llm = LLM(path, tensor_parallel_size=2)
    try:
        worker = llm.engine.tp_workers.procs[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match="tandem-tp-rank1 exited"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_a_rank_lost_in_the_middle_of_a_generation_fails_it_by_name(tmp_path):
    """Killed while steps run (mid-step or between two): the step fails
    naming the worker and how it ended, not with the collective's own error
    (gloo's connection reset, or on GPUs NCCL's wait for ever)."""
    import threading

    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, tensor_parallel_size=2)
    try:
        worker = llm.engine.tp_workers.procs[0]
        threading.Timer(1.0, worker.kill).start()
        with pytest.raises(RuntimeError, match="tandem-tp-rank1 exited with code -9; the engine cannot step"):
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=2000, ignore_eos=True))
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_a_worker_that_dies_before_joining_fails_the_engine_instead_of_hanging(tmp_path):
    """The commonest way: a script without the `if __name__ == '__main__':`
    guard, whose spawned worker imports it and dies. Rank 0 used to wait
    for it to join the group for ever."""
    import subprocess
    import sys

    path, _ = tiny_model_dir(tmp_path, "llama")
    script = tmp_path / "no_main_guard.py"
    script.write_text(f"from tandem.engine import LLM\nLLM({path!r}, tensor_parallel_size=2)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0
    assert "tensor-parallel worker tandem-tp-rank1 exited with code 1 before joining" in proc.stderr
    assert "if __name__ == '__main__':" in proc.stderr


def test_plans_reach_a_worker_through_its_pipe_and_one_that_is_gone_fails_by_name():
    import multiprocessing

    from tandem.engine.tp_channel import PlanSender, WorkerGone, receive

    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = PlanSender([writer], ["tandem-tp-rank1"])
    sender.send(({"ids": [1, 2]}, None))
    assert receive(reader) == ({"ids": [1, 2]}, None)
    reader.close()  # the worker exited
    with pytest.raises(WorkerGone, match="tandem-tp-rank1 exited"):
        sender.send(None)


@pytest.mark.timeout(300)
def test_tp2_preemption_swaps_each_ranks_heads_to_the_host_tier_and_matches_hf(tmp_path):
    """Too few blocks for the batch: preempted requests' blocks go to the host
    tier (each rank copies its own heads) and come back; nothing is
    computed twice, and the tokens are HF's."""
    path, hf = tiny_model_dir(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4)
    rng = random.Random(11)
    # Two blocks each at first (12 of 13), three each once they decode past 32 tokens.
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (28, 31, 30, 29, 27, 32)]
    refs = [hf_greedy(hf, p, MAX_NEW, eos_token_id=None) for p in prompts]
    # A rank's block: 2 layers x K/V x 16 tokens x 2 KV heads x head_dim 8 x 4 bytes.
    block_bytes = 2 * 2 * 16 * 2 * 8 * 4
    llm = LLM(path, tensor_parallel_size=2, num_blocks=14, swap_space=100 * block_bytes / 2**30,
              admission="greedy")  # all six start: preemption happens
    try:
        assert llm.engine.runner.num_host_slots == 100
        check_against_oracle(run_greedy(llm, prompts, MAX_NEW), refs, exact=False)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0, "the test must force preemption"
        assert stats.kv_swapped_out_blocks > 0 and stats.kv_swapped_in_blocks > 0
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_tp2_with_ngram_speculation_matches_hf(tmp_path):
    """Drafts ride in the plan, every rank verifies them in one forward and
    rank 0 rejects them (a random model copies nothing: this is the
    rejection path; acceptance under TP is not exercised here): the tokens
    stay HF's greedy ones."""
    path, hf = tiny_model_dir(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4)
    rng = random.Random(5)
    prompts = []
    for n in (6, 9, 13):
        piece = [rng.randrange(2, 512) for _ in range(n)]
        prompts.append(piece * 4)  # repeats: the n-gram lookup finds something to propose
    max_new = 24
    refs = [hf_greedy(hf, p, max_new, eos_token_id=None) for p in prompts]
    llm = LLM(path, tensor_parallel_size=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    try:
        check_against_oracle(run_greedy(llm, prompts, max_new), refs, exact=False)
        stats = llm.engine.stats()
        assert stats.spec_decode_num_draft_tokens > 0, stats
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_tp2_with_a_draft_model_accepts_its_drafts_and_matches_hf(tmp_path):
    """The draft (here the model itself: it proposes what the target will
    say) stays whole on rank 0, outside the group; the target's ranks verify
    its drafts and rank 0 accepts them: many tokens a step, HF's tokens."""
    path, hf = tiny_model_dir(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=4)
    rng = random.Random(9)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 17, 40)]
    max_new = 20
    refs = [hf_greedy(hf, p, max_new, eos_token_id=None) for p in prompts]
    llm = LLM(path, tensor_parallel_size=2, speculative_config={"model": path, "num_speculative_tokens": 3,
                                                                      "adaptive": False})
    try:
        draft = llm.engine.speculator.proposer.runner.model.model.layers[0].self_attn
        assert draft.num_heads == 8  # whole, while the target's rank 0 holds 4
        check_against_oracle(run_greedy(llm, prompts, max_new), refs, exact=False)
        stats = llm.engine.stats()
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens // 2, stats
    finally:
        llm.shutdown()
