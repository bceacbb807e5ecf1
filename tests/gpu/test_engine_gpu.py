"""The engine on CUDA (Triton kernels, CUDA graphs) against HF transformers on
the same GPU: token-exact greedy in fp32 (near ties excepted, as on the CPU),
and, in bf16, errors against an fp32 oracle of the size of HF bf16's own; the
>= 99% greedy agreement with HF bf16 that issue 4 asks is its own test (not met yet)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.support.hf_oracle import compare_with_tie_rule, tiny_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LENGTHS = [1, 5, 17, 33, 64, 150, 300, 600]


def prompts(seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]


# The MoE models run the routing, alignment and grouped-GEMM kernels of
# kernels/moe_routing_triton.py and fused_moe_triton.py.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("mode", ["eager", "cuda-graphs", "piecewise", "no-piecewise"])
def test_fp32_greedy_matches_hf_on_gpu(tmp_path, arch, mode):
    """piecewise: a 64-token budget, so prompts go in chunks beside decodes,
    every such step through the piecewise graphs (engine/piecewise_graphs.py);
    no-piecewise: the same under --no-piecewise-cuda-graphs, those steps eager."""
    from tandem.engine import LLM, SamplingParams

    path, hf = tiny_model_dir(tmp_path, arch)
    hf = hf.cuda()
    ps = prompts()
    budget = {"max_num_batched_tokens": 64} if mode.endswith("piecewise") else {}
    llm = LLM(path, device="cuda", dtype="float32", enforce_eager=mode == "eager", num_blocks=1024,
              piecewise_cuda_graphs=mode != "no-piecewise", **budget)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True))
    runner = llm.engine.runner
    if mode == "piecewise":
        assert runner.piecewise.replays > 0
    elif mode == "no-piecewise":
        assert runner.piecewise is None and runner.graphs is not None
    for p, out in zip(ps, outs):
        ref = hf_greedy_cuda(hf, p, 16)
        c = out.outputs[0]
        n = compare_with_tie_rule(c.token_ids, [lp.top for lp in c.logprobs], ref, exact=False)
        assert [lp.logprob for lp in c.logprobs[:n]] == pytest.approx(ref.logprobs[:n], abs=1e-3)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="an FP8 KV cache needs compute capability 8.9+")
@pytest.mark.parametrize("mode", ["cuda-graphs", "piecewise"])
def test_fp8_kv_cache_kernels_give_the_twins_greedy_tokens(tmp_path, mode):
    """--kv-cache-dtype fp8 has no HF oracle: the Triton kernels (the write,
    decode and prefill attention on e4m3 blocks, in CUDA graphs) are checked
    against the engine on their torch twins on the same GPU, fp32 otherwise.
    Every greedy token must agree. The logprobs drift more than in fp32
    caches: the two paths' hidden states differ in the last bits, and where
    a key or value lies that close to the midpoint between two e4m3 values,
    the two caches round it to neighbours 6-12% apart; the steep head (x8)
    and the random weights' sharp attention magnify that. Measured on the
    H200 (2026-11-29): every token equal, largest drift 0.24 in both modes.
    Bit for bit, the write matches its twin (kernels/selfcheck.py)."""
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "llama", lm_head_scale=8.0)
    ps = prompts()
    budget = {"max_num_batched_tokens": 64} if mode == "piecewise" else {}
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cuda", dtype="float32", kv_cache_dtype="fp8", num_blocks=1024,
                  attention_backend=backend, **budget)
        assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        runs[backend] = [o.outputs[0] for o in llm.generate(ps, params)]
        if backend == "triton" and mode == "piecewise":
            assert llm.engine.runner.piecewise.replays > 0
        llm.shutdown()
    differ = [i for i, (a, b) in enumerate(zip(runs["torch"], runs["triton"])) if a.token_ids != b.token_ids]
    drift = max(abs(a.logprob - b.logprob) for t, k in zip(runs["torch"], runs["triton"])
                for a, b in zip(t.logprobs, k.logprobs))
    print(f"FP8 KV cache, kernels against twins ({mode}): prompts that differ {differ}, "
          f"largest logprob difference {drift:.2e}")
    assert not differ and drift < 0.5


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_heads_outer_blocks_give_the_same_tokens_through_the_kernels(tmp_path, kv_cache_dtype):
    """--kv-cache-layout HND against NHD on the Triton kernels (writes, decode
    and prompt attention, CUDA graphs and piecewise graphs: a 64-token budget):
    the same arithmetic over other addresses, so the same tokens and logprobs."""
    from tandem.engine import LLM, SamplingParams

    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("an FP8 KV cache needs compute capability 8.9+")
    path, _ = tiny_model_dir(tmp_path, "llama")
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    runs = {}
    for layout in ("NHD", "HND"):
        llm = LLM(path, device="cuda", dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_layout=layout,
                  num_blocks=1024, max_num_batched_tokens=64)
        assert llm.engine.runner.kv_cache.is_contiguous() == (layout == "NHD")
        runs[layout] = [o.outputs[0] for o in llm.generate(ps, params)]
        assert llm.engine.runner.piecewise.replays > 0
        llm.shutdown()
    for a, b in zip(runs["NHD"], runs["HND"]):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-5)


def hf_greedy_cuda(hf, prompt, n):
    # hf_greedy builds CPU tensors; move them for a CUDA model
    from tests.support.hf_oracle import OracleRun

    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                          pad_token_id=0, temperature=None, top_p=None, top_k=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps, top5 = [], []
    for step, tok in enumerate(tokens):
        lp = torch.log_softmax(out.logits[step][0].float(), dim=-1).cpu()
        lps.append(float(lp[tok]))
        v, i = torch.topk(lp, 5)
        top5.append(dict(zip(i.tolist(), v.tolist())))
    return OracleRun(tokens, lps, top5)


@pytest.mark.xfail(strict=False, reason=(
    "random weights decide many positions below bf16's resolution: 96.3% measured on the H100 "
    "(2026-11-23); the 99% goal is checked on trained weights in test_bf16_agreement_gpu.py (99.5%)"))
def test_bf16_greedy_agrees_with_hf_on_99_percent_of_tokens_with_random_weights(tmp_path):
    """The issue's 99% figure on the tiny random-weight model. Its near-uniform
    logits put many top-two pairs within bf16 noise, so two bf16 runs (HF's and
    ours) disagree there: 95.9-96.3% measured, hence xfail (not strict: it may
    pass one day and says so). The goal itself is asserted on the real
    SmolLM2 in tests/gpu/test_bf16_agreement_gpu.py; the noise-relative test
    below bounds our error by HF bf16's own. Per-token agreement under teacher
    forcing: at every position both see the same history (prompt + HF's greedy
    continuation) and we compare their next-token argmax. HF's choices come from one full forward pass over each
    history, so neither side mixes incremental and full computation."""
    from tandem.engine import LLM, SamplingParams

    path, hf = tiny_model_dir(tmp_path, "llama")
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    llm = LLM(path, device="cuda", dtype="bfloat16", num_blocks=4096)
    histories, expected, second, tie_limit = [], [], [], []
    for p in prompts(seed=2) + prompts(seed=3):
        ref = hf_greedy_cuda(hf, p, 32).tokens
        with torch.no_grad():
            logits = hf(torch.tensor([p + ref], device="cuda")).logits[0].float()
        for t in range(len(ref)):
            row = logits[len(p) - 1 + t]
            values, ids = torch.topk(row, 2)
            histories.append(p + ref[:t])
            expected.append(int(ids[0]))
            # Logits come out of a bf16 matrix product: two logits one bf16 step
            # apart (2^-7 relative) are a tie at that precision, the bf16
            # counterpart of the near-tie rule used for random weights in fp32.
            second.append(int(ids[1]))
            step = 2.0 ** (torch.floor(torch.log2(values[0].abs())) - 7)
            tie_limit.append(float(values[0] - values[1]) <= float(step))
    outs = llm.generate(histories, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    ours = [o.outputs[0].token_ids[0] for o in outs]
    exact = sum(a == e for a, e in zip(ours, expected))
    ties = sum(a != e and a == s and tie for a, e, s, tie in zip(ours, expected, second, tie_limit))
    n = len(expected)
    print(f"bf16 greedy agreement (teacher-forced): exact {exact}/{n} = {exact / n:.4f}; "
          f"with one-bf16-step ties {exact + ties}/{n} = {(exact + ties) / n:.4f}")
    assert (exact + ties) / n >= 0.99


def test_bf16_error_is_of_the_size_of_hf_bf16s_own(tmp_path):
    """bf16 is judged against bf16's own rounding noise, measured on HF.

    The oracle is HF in fp32 on the bf16-rounded weights (the exact weights both
    bf16 runs use). At every position HF bf16 and the engine in bf16 see the
    same history (prompt + the oracle's greedy continuation). Two measures:

    - the log-probability each gives the oracle's token, against the oracle's
      (the engine's comes from logprobs=2): the engine's median and p99 error
      must be within 2x of HF bf16's;
    - greedy agreement with the oracle where its top two logits are at least
      DECISIVE_STEPS bf16 steps (2^-7 relative) apart: >= 95%. Tiny random
      weights give near-uniform logits, so many positions are decided below
      bf16's resolution, and HF bf16 misses the oracle there too; a real bug
      (a wrong mask, a stale block) drops agreement far below that.
    """
    from tandem.engine import LLM, SamplingParams

    DECISIVE_STEPS = 4
    path, hf = tiny_model_dir(tmp_path, "llama")
    hf_bf16 = hf.to(device="cuda", dtype=torch.bfloat16)
    oracle = copy.deepcopy(hf_bf16).float()  # bf16-rounded weights, fp32 arithmetic
    llm = LLM(path, device="cuda", dtype="bfloat16", num_blocks=4096)
    histories, expected, hf_picks, margins, oracle_lp, hf_lp = [], [], [], [], [], []
    with torch.no_grad():
        for p in prompts(seed=2) + prompts(seed=3):
            ref = hf_greedy_cuda(oracle, p, 32).tokens
            ids = torch.tensor([p + ref], device="cuda")
            logits = oracle(ids).logits[0]
            lp_oracle = torch.log_softmax(logits, -1)
            lp_hf = torch.log_softmax(hf_bf16(ids).logits[0].float(), -1)
            top2 = torch.topk(logits, 2, dim=-1)
            step = torch.exp2(torch.floor(torch.log2(top2.values[:, 0].abs())) - 7)
            margin = ((top2.values[:, 0] - top2.values[:, 1]) / step).tolist()
            want = top2.indices[:, 0].tolist()
            got = lp_hf.argmax(-1).tolist()
            for t in range(len(ref)):
                at = len(p) - 1 + t
                histories.append(p + ref[:t])
                expected.append(want[at])
                hf_picks.append(got[at])
                margins.append(margin[at])
                oracle_lp.append(float(lp_oracle[at, want[at]]))
                hf_lp.append(float(lp_hf[at, want[at]]))
    outs = llm.generate(histories, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2))
    ours = [o.outputs[0].token_ids[0] for o in outs]
    # The oracle's token among the engine's chosen and top-2 logprobs (it is the
    # engine's own pick wherever the two agree; elsewhere usually its top-1 or top-2).
    ours_lp = []
    for o, e in zip(outs, expected):
        entry = o.outputs[0].logprobs[0]
        table = dict(entry.top)
        table[o.outputs[0].token_ids[0]] = entry.logprob
        ours_lp.append(table.get(e))
    known = [i for i, v in enumerate(ours_lp) if v is not None]
    engine_err = torch.tensor([abs(ours_lp[i] - oracle_lp[i]) for i in known])
    hf_err = torch.tensor([abs(hf_lp[i] - oracle_lp[i]) for i in known])
    q = torch.tensor([0.5, 0.99])
    engine_q, hf_q = engine_err.quantile(q).tolist(), hf_err.quantile(q).tolist()
    n = len(expected)
    decisive = [i for i, m in enumerate(margins) if m >= DECISIVE_STEPS]
    engine_agree = sum(ours[i] == expected[i] for i in decisive) / len(decisive)
    hf_agree = sum(hf_picks[i] == expected[i] for i in decisive) / len(decisive)
    print(f"{n} positions; |logprob - oracle| of the oracle's token over {len(known)}: "
          f"engine p50 {engine_q[0]:.2e} p99 {engine_q[1]:.2e}, HF bf16 p50 {hf_q[0]:.2e} p99 {hf_q[1]:.2e}")
    print(f"greedy agreement, all: engine {sum(a == e for a, e in zip(ours, expected)) / n:.4f}, "
          f"HF bf16 {sum(a == e for a, e in zip(hf_picks, expected)) / n:.4f}; "
          f"margin >= {DECISIVE_STEPS} steps ({len(decisive)}): engine {engine_agree:.4f}, HF bf16 {hf_agree:.4f}")
    assert len(known) >= 0.95 * n
    assert engine_q[0] <= 2 * hf_q[0] and engine_q[1] <= 2 * hf_q[1]
    assert engine_agree >= 0.95


def test_a_large_gpu_runs_vllms_larger_default_batches(tmp_path):
    """1024 requests at once and 16384 tokens a step offline on GPUs of 70 GiB
    or more (A100s aside); the CUDA graphs cover every batch size up to it."""
    from tandem.engine import LLM

    props = torch.cuda.get_device_properties(0)
    large = props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()
    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cuda", num_blocks=2048)
    sched = llm.engine.config.scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == ((1024, 16384) if large else (256, 8192))
    assert llm.engine.runner.graphs.sizes[-1] == sched.max_num_seqs


def test_sampled_requests_are_drawn_on_the_gpu(tmp_path, monkeypatch):
    """Temperature sampling never copies the logits to the CPU sampler on a
    GPU engine (it would fail here), and a seed repeats its tokens."""
    from tandem.engine import LLM, SamplingParams
    from tandem.engine.sampler import Sampler

    def no_cpu_sampling(*args, **kwargs):
        raise AssertionError("a sampled batch went to the CPU sampler")

    monkeypatch.setattr(Sampler, "_sample", no_cpu_sampling)
    path, _ = tiny_model_dir(tmp_path, "llama")
    llm = LLM(path, device="cuda", num_blocks=512)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=4, max_tokens=12, logprobs=2,
                            ignore_eos=True)
    first, again = (llm.generate(prompts()[:4], params) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].logprobs) == 12 for o in first)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_asynchronous_scheduling_answers_as_step_by_step(tmp_path, temperature):
    """On by default on a GPU: each step's inputs read the step before's
    tokens on the device, and its tokens reach the host a step later; the
    answers are those of the engine that waits for every step."""
    from tandem.engine import LLM, SamplingParams

    path, _ = tiny_model_dir(tmp_path, "llama")
    params = [SamplingParams(temperature=temperature, seed=3 + i, max_tokens=8 + 5 * i, stop_token_ids=[7],
                             logprobs=2) for i in range(len(LENGTHS))]
    answers = {}
    for mode in ("auto", "off"):
        llm = LLM(path, device="cuda", dtype="float32", async_scheduling=mode, num_blocks=1024,
                  max_num_batched_tokens=256)
        assert llm.engine.async_scheduling == (mode == "auto")
        outs = llm.generate(prompts(), params)
        answers[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                          [round(lp.logprob, 4) for lp in o.outputs[0].logprobs]) for o in outs]
        pool = llm.engine.kv.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
    assert answers["auto"] == answers["off"]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="an FP8 KV cache needs compute capability 8.9+")
def test_the_triton_write_and_attention_apply_a_checkpoints_kv_scales(tmp_path):
    """The GPU's side of tests/unit/test_fp8_kv_cache.py's scales test: keys
    and values past 448, the checkpoint's scales, the Triton kernels in CUDA
    graphs against the fp32 cache's tokens (75/96 on the CPU's twins)."""
    from tests.support.kv_scales import large_kv_model, teacher_forced_agreement

    plain, scaled = large_kv_model(tmp_path, scales=False), large_kv_model(tmp_path, scales=True)
    agreed, n, key = teacher_forced_agreement(scaled, plain, device="cuda", dtype="float32", kv_cache_dtype="fp8")
    assert agreed >= 0.6 * n and key.endswith("|kv-scales"), (agreed, n, key)
