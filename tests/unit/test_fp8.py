"""FP8 weights (engine/fp8.py, kernels/fp8_torch.py) on the CPU.

The oracle for the engine is HF transformers with the same FP8 arithmetic
written into it independently: its linear weights replaced by their e4m3
values times per-channel scales, and a hook that rounds each linear layer's
input to e4m3 per token, except in a call of one token (the engine leaves a
step of one token unquantized: WEIGHT_ONLY_MAX_ROWS); MoE experts round
their inputs per row in every call (round_expert_inputs). A tiny random
Llama and Qwen3 quantized at load must generate what that model generates; an HF FP8
checkpoint (per-tensor, per-channel and block-wise scales) must load into the
same numbers; the real SmolLM2 must stay close to its bf16 self."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import random
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from tandem.engine import LLM, SamplingParams
from tandem.engine.config import ConfigError, EngineArgs
from tandem.engine.fp8 import Fp8Linear, QuantizationError, effective_quantization
from tandem.kernels.fp8_torch import WEIGHT_ONLY_MAX_ROWS, fp8_linear_torch, quantize_weight
from tests.support.hf_oracle import hf_greedy, run_greedy, tiny_model_dir

E4M3 = torch.float8_e4m3fn
LENGTHS = [1, 5, 17, 33, 64, 150]
MAX_NEW = 16


def _e4m3_round(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x rounded to e4m3 with one scale per slice along `dim` (its largest
    magnitude -> 448), back in fp32: the oracle's own FP8, not the engine's."""
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale).to(E4M3).float() * scale


@dataclasses.dataclass
class InputRounding:
    """The oracle's rule for a linear layer's input: rounded to e4m3 per token
    unless the call holds at most `unquantized_rows` tokens."""
    unquantized_rows: int = 0

    def __call__(self, _module: nn.Module, args: tuple) -> Optional[tuple]:
        x = args[0]
        if x.numel() // x.shape[-1] <= self.unquantized_rows:
            return None
        return (_e4m3_round(x).to(x.dtype),)


def _fake_quantize_hf(model: nn.Module, rounding: InputRounding) -> nn.Module:
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.startswith("model.layers."):
                module.weight.copy_(_e4m3_round(module.weight))
                module.register_forward_pre_hook(rounding)
    return model


def test_quantize_weight_maps_each_rows_largest_value_to_448_and_rounds_within_e4m3():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64).unsqueeze(1)
    q, scale = quantize_weight(w)
    assert q.dtype == E4M3 and scale.shape == (64,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), 448.0))
    back = q.float() * scale.unsqueeze(1)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself
    normal = w.abs() > scale.unsqueeze(1) * 2.0 ** -6
    assert ((back - w).abs() <= w.abs() / 16 + 1e-12)[normal].all()


def test_fp8_linear_twin_is_the_product_of_the_rounded_operands():
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 96), torch.randn(40, 96), torch.randn(40)
    q, scale = quantize_weight(w)
    ours = fp8_linear_torch(x, q, scale, b)
    expected = _e4m3_round(x).double() @ _e4m3_round(w).double().t() + b.double()
    assert torch.allclose(ours.double(), expected, rtol=1e-5, atol=1e-5)
    # and it is not the unquantized product: the rounding is really there
    assert not torch.allclose(ours, x @ w.t() + b, rtol=1e-3, atol=1e-3)


def test_fp8_linear_twin_leaves_one_row_unquantized():
    """A step of one token multiplies its activations, unrounded, by the e4m3
    weights (WEIGHT_ONLY_MAX_ROWS); two rows are rounded."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 96), torch.randn(40, 96), torch.randn(40)
    q, scale = quantize_weight(w)
    one = fp8_linear_torch(x[:1], q, scale, b)
    assert torch.allclose(one.double(), x[:1].double() @ _e4m3_round(w).double().t() + b.double(),
                          rtol=1e-5, atol=1e-5)
    rounded = _e4m3_round(x[:1]).double() @ _e4m3_round(w).double().t() + b.double()
    assert not torch.allclose(one.double(), rounded, rtol=1e-3, atol=1e-3)
    assert torch.allclose(fp8_linear_torch(x, q, scale, b)[:1].double(), rounded, rtol=1e-5, atol=1e-5)


def test_fused_fp8_projections_equal_the_separate_ones():
    torch.manual_seed(1)
    parts = [Fp8Linear.quantized(nn.Linear(64, n, bias=True)) for n in (32, 16, 16)]
    fused = Fp8Linear.concat(parts)
    x = torch.randn(5, 64)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path, hf = tiny_model_dir(tmp_path_factory.mktemp("fp8"), request.param)
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    rounding = InputRounding()
    oracle = _fake_quantize_hf(hf, rounding)
    # HF generates each prompt alone: its decode calls hold one token. The
    # engine generating the six together decodes six a step, all quantized;
    # one prompt alone, one a step, none quantized.
    together = [hf_greedy(oracle, p, MAX_NEW, eos_token_id=None) for p in prompts]
    rounding.unquantized_rows = WEIGHT_ONLY_MAX_ROWS
    alone = [hf_greedy(oracle, p, MAX_NEW, eos_token_id=None) for p in prompts]
    return {"path": path, "prompts": prompts, "together": together, "alone": alone}


# Together: one step prefills the six prompts, then each decode step holds six
# tokens. Alone and chunked (24-token chunks: none of one token), each prompt
# its own generate call: steps of one token are its decode steps, and a
# 1-token prompt's prefill, as in HF.
@pytest.mark.parametrize("batching, options", [
    ("together", {}), ("alone", {"max_num_batched_tokens": 40, "long_prefill_token_threshold": 24})],
    ids=["together-plain", "alone-chunked"])
def test_tiny_models_quantized_at_load_match_hf_with_the_same_fp8_rounding(tiny, batching, options):
    llm = LLM(tiny["path"], quantization="fp8", **options)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert isinstance(llm.engine.runner.model.lm_head, nn.Linear)  # the LM head stays in the model dtype
    if batching == "together":
        outs = run_greedy(llm, tiny["prompts"], MAX_NEW)
    else:
        outs = [run_greedy(llm, [p], MAX_NEW)[0] for p in tiny["prompts"]]
    exact = [_same_tokens_and_logprobs(out.outputs[0], ref) for out, ref in zip(outs, tiny[batching])]
    # Quantization amplifies the last fp32 bit: an input one ulp from an e4m3
    # rounding midpoint (the two sides sum in different orders) rounds the
    # other way and shifts its whole row by a step, and a long prompt has
    # many such inputs. Measured: every llama prompt and 4 of 6 qwen3 ones
    # agree to 1e-5 (the others drift by up to 0.06 from the prompt on).
    assert sum(exact) >= 4, f"prompts that agree with the oracle: {exact}"


def _same_tokens_and_logprobs(ours, ref) -> bool:
    return ours.token_ids == ref.tokens and all(
        abs(lp.logprob - r) < 1e-4 for lp, r in zip(ours.logprobs, ref.logprobs))


def _write_fp8_checkpoint(src: str, dst: str, form: str) -> dict:
    """An HF FP8 checkpoint of the bf16 folder `src`: e4m3 weights of the
    decoder's linear layers with `form` scales (per-tensor: AutoFP8's format,
    with static input scales; per-channel; block: weight_scale_inv over
    [16, 32] blocks, transformers' FineGrainedFP8 format)."""
    state = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for key, tensor in state.items():
        # Mixtral names its experts' projections w1, w2, w3; routers (mlp.gate) stay as they are
        linear = key.startswith("model.layers.") and key.endswith(("_proj.weight", ".w1.weight", ".w2.weight",
                                                                    ".w3.weight"))
        if not linear:
            out[key] = tensor
            continue
        base = key[:-len(".weight")]
        if form == "per-channel":
            out[key], out[base + ".weight_scale"] = quantize_weight(tensor)
        elif form == "per-tensor":
            scale = tensor.abs().amax() / 448.0
            out[key] = (tensor / scale).to(E4M3)
            out[base + ".weight_scale"] = scale.reshape(())
            out[base + ".input_scale"] = torch.tensor(0.05)
        else:
            blocks = tensor.reshape(tensor.shape[0] // 16, 16, tensor.shape[1] // 32, 32)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            full = scale.repeat_interleave(16, 0).repeat_interleave(32, 1)
            out[key] = (tensor / full).to(E4M3)
            out[base + ".weight_scale_inv"] = scale
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if form == "block":
        config["quantization_config"]["weight_block_size"] = [16, 32]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.mark.parametrize("form", ["per-channel", "per-tensor", "block"])
def test_hf_fp8_checkpoints_load_as_fp8(tmp_path, form):
    src, _ = tiny_model_dir(tmp_path, "llama")
    written = _write_fp8_checkpoint(src, str(tmp_path / form), form)
    llm = LLM(str(tmp_path / form))  # no flag: the checkpoint's quantization_config decides
    proj = llm.engine.runner.model.model.layers[1].mlp.up_proj
    assert isinstance(proj, Fp8Linear)
    loaded = proj.weight.float() * proj.weight_scale.unsqueeze(1)
    _assert_loaded_as_written(loaded, written, "model.layers.1.mlp.up_proj", form)
    if form == "per-channel":
        _assert_same_tokens_as_quantizing_at_load(llm, src)


def _assert_loaded_as_written(loaded: torch.Tensor, written: dict, base: str, form: str) -> None:
    """`loaded` (fp32 values of an FP8 layer) against the checkpoint's `base`."""
    q = written[base + ".weight"].float()
    if form == "block":
        scale = written[base + ".weight_scale_inv"]
        expected = q * scale.repeat_interleave(16, 0).repeat_interleave(32, 1)
        # quantized again per channel: one more e4m3 rounding
        assert torch.allclose(loaded, expected, rtol=1 / 16, atol=1e-6), base
    else:
        assert torch.equal(loaded, q * written[base + ".weight_scale"].float().reshape(-1, 1)), base


def _assert_same_tokens_as_quantizing_at_load(llm: LLM, src: str) -> None:
    """A per-channel checkpoint holds the e4m3 values and scales that
    quantizing the bf16 folder at load makes: the same greedy tokens."""
    prompts = [[random.Random(n).randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    at_load = [o.outputs[0].token_ids for o in LLM(src, quantization="fp8").generate(prompts, greedy)]
    assert ours == at_load


def test_fp8_refuses_what_it_cannot_run(tmp_path):
    from transformers import LlamaConfig

    gptq = LlamaConfig(quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(QuantizationError, match="'gptq'"):
        effective_quantization(gptq, None, torch.device("cpu"))
    assert effective_quantization(LlamaConfig(), None, torch.device("cpu")) is None
    with pytest.raises(ConfigError, match="--quantization"):
        EngineArgs(quantization="int4").create_engine_config()


# ---- mixture-of-experts models: e4m3 experts, the router in the model dtype ----

@contextlib.contextmanager
def _inputs_rounded_to_e4m3():
    """F.linear, while inside, rounds its input to e4m3 per row first."""
    linear = F.linear
    F.linear = lambda x, weight, bias=None: linear(_e4m3_round(x).to(x.dtype), weight, bias)
    try:
        yield
    finally:
        F.linear = linear


def round_expert_inputs(experts: nn.Module) -> None:
    """The oracle's rule for the experts' inputs (the engine's W8A8 experts):
    each F.linear an experts module makes (HF's experts call it for gate/up
    and for down) gets its input rounded to e4m3 per row."""
    forward = experts.forward

    def rounding_forward(*args, **kwargs):
        with _inputs_rounded_to_e4m3():
            return forward(*args, **kwargs)

    experts.forward = rounding_forward


def _fake_quantize_hf_experts(model: nn.Module) -> nn.Module:
    """The oracle's FP8 experts: each expert's output channels rounded to
    e4m3 (HF's stacked gate_up_proj [E, 2I, H] and down_proj [E, H, I]), and
    their inputs by round_expert_inputs's rule. The experts run HF's eager
    loop (one F.linear per projection, where the inputs are rounded), not
    its default grouped GEMM."""
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(_e4m3_round(p, dim=-1))
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            round_expert_inputs(module)
    return model


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny_moe(request, tmp_path_factory):
    path, hf = tiny_model_dir(tmp_path_factory.mktemp("fp8moe"), request.param)
    return {"path": path, "hf": hf, "llm": LLM(path, quantization="fp8")}


def test_fp8_experts_compute_what_hf_computes_with_the_rounded_weights(tiny_moe):
    """One sparse layer's MLP on the same 37 rows: the engine's e4m3 experts
    (W8A8; its router not quantized) against HF's block with each
    expert's weights and inputs rounded by the oracle's own e4m3. Measured
    2026-11-28 on the dev machine: 6.7e-7 of the largest output (qwen3_moe;
    fp32 noise); left unrounded, the oracle's inputs put it at 3e-2, and a
    scale on the wrong axis or a missing one is off by far more."""
    from tandem.engine.models.moe import SparseMoeBlock

    model = tiny_moe["llm"].engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.experts.gate_up_proj.dtype == E4M3 and b.experts.down_proj.dtype == E4M3
                          for b in blocks)
    assert blocks[0].experts.gate_up_proj_scale.shape == blocks[0].experts.gate_up_proj.shape[:2]
    assert all(type(b.gate) is nn.Linear for b in blocks)  # the router is not quantized
    assert isinstance(model.model.layers[0].self_attn.o_proj, Fp8Linear)
    oracle = _fake_quantize_hf_experts(copy.deepcopy(tiny_moe["hf"]))
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.model.layers[0].mlp(x)
        theirs = oracle.model.layers[0].mlp(x.unsqueeze(0))
    theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).reshape(ours.shape)
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max() * 10


def test_tiny_moe_models_quantized_at_load_generate_what_hf_generates_with_the_same_rounding(tiny_moe):
    """Whole models, FP8 in attention (inputs rounded per token) and in the
    experts, against HF with the same rounding written in. Each prompt's
    first token agrees, its logprob within 1e-3 (one prompt's was 1.1e-4
    off); later ones drift where an input one ulp from an e4m3 rounding
    midpoint rounds the other way, and a router near a tie then picks
    another expert. Measured 2026-11-28 on the dev machine, experts W8A8: 6
    and 2 of 6 prompts whole (qwen3_moe, mixtral)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    # The engine runs the six prompts together: every step of its dense FP8
    # layers holds more than one token and quantizes, while HF's calls for a
    # one-token prompt and for each decode hold one. So the oracle rounds
    # every call's inputs.
    oracle = _fake_quantize_hf_experts(_fake_quantize_hf(copy.deepcopy(tiny_moe["hf"]), InputRounding()))
    refs = [hf_greedy(oracle, p, MAX_NEW, eos_token_id=None) for p in prompts]
    outs = [o.outputs[0] for o in run_greedy(tiny_moe["llm"], prompts, MAX_NEW)]
    for out, ref in zip(outs, refs):
        assert out.token_ids[0] == ref.tokens[0] and abs(out.logprobs[0].logprob - ref.logprobs[0]) < 1e-3
    exact = [_same_tokens_and_logprobs(out, ref) for out, ref in zip(outs, refs)]
    assert sum(exact) >= 2, f"prompts that agree with the oracle: {exact}"


@pytest.mark.parametrize("form", ["per-channel", "block"])
def test_hf_fp8_moe_checkpoints_load_each_experts_scales(tmp_path, form):
    """An FP8 checkpoint whose experts are stored one by one (the Hub's
    Qwen3-30B-A3B-FP8 form: e4m3 with weight_scale_inv blocks) loads into the
    stacked e4m3 experts with each expert's own channel scales."""
    src, _ = tiny_model_dir(tmp_path, "qwen3_moe")
    written = _write_fp8_checkpoint(src, str(tmp_path / form), form)
    llm = LLM(str(tmp_path / form))
    experts = llm.engine.runner.model.model.layers[2].mlp.experts  # layer 1 is dense
    inter = experts.gate_up_proj.shape[1] // 2
    for e in (0, 5):
        up = experts.gate_up_proj[e, inter:].float() * experts.gate_up_proj_scale[e, inter:].unsqueeze(1)
        down = experts.down_proj[e].float() * experts.down_proj_scale[e].unsqueeze(1)
        for loaded, proj in ((up, "up_proj"), (down, "down_proj")):
            _assert_loaded_as_written(loaded, written, f"model.layers.2.mlp.experts.{e}.{proj}", form)
    if form == "per-channel":
        _assert_same_tokens_as_quantizing_at_load(llm, src)


@pytest.mark.timeout(300)
def test_an_fp8_moe_checkpoint_split_across_two_ranks_starts_as_one_rank_does(tmp_path):
    """Tensor parallelism over e4m3 experts: each rank keeps half of every
    expert's gate/up rows with their scales and half of its down columns with
    all of its output channels' scales (a checkpoint's scales span the whole
    row, so both halves use them), and the block's output is summed over the
    ranks. One-token prompts run one at a time, so every dense FP8 layer is
    weight-only. The experts are W8A8, and each rank quantizes its half of
    the down projection's input with a scale of its own, as vLLM does, so
    TP=2 rounds differently from TP=1: the first token's logprob was at most
    0.057 off (2026-11-28, dev machine) and later tokens drift. So the first
    token must agree and its logprob lie within 0.1; a rank with another
    rank's scales or shard is off by far more."""
    src, _ = tiny_model_dir(tmp_path, "qwen3_moe")
    dst = str(tmp_path / "fp8")
    _write_fp8_checkpoint(src, dst, "per-channel")
    prompts = [[7], [100], [333]]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    llm = LLM(dst)
    one = [llm.generate([p], greedy)[0].outputs[0] for p in prompts]
    llm = LLM(dst, tensor_parallel_size=2)
    try:
        experts = llm.engine.runner.model.model.layers[2].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale.shape == (8, 32)
        assert experts.down_proj_scale.shape == (8, 64)  # every output channel on every rank
        two = [llm.generate([p], greedy)[0].outputs[0] for p in prompts]
    finally:
        llm.shutdown()
    for a, b in zip(one, two):
        assert a.token_ids[0] == b.token_ids[0]
        assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=0.1)


def test_fp8_smollm2_agrees_with_bf16_on_most_greedy_tokens():
    """Measured 2026-11-26 on the dev machine: 356/384 (92.7%). The issue's
    goal is 97%; SmolLM2-135M does not reach it with e4m3 weights whatever the
    scale granularity (weights alone, activations unquantized: 94.0% per
    channel, 93.5% with a scale per 32 weights; bf16 against itself in
    another batch: 98.4%), so the bound here is what catches a broken
    quantization (a wrong scale axis scores near 0)."""
    from tests.support.fp8_agreement import fp8_agreement

    agreed, n = fp8_agreement("cpu")
    assert agreed >= 0.88 * n


@pytest.mark.timeout(300)
def test_fp8_smollm2_split_across_three_ranks_agrees_with_bf16_as_much():
    """Quantized at load under TP=3: each rank quantizes its shard (a
    row-parallel layer's channel scales over its slice of the inputs, the
    activations' per-token scales over its slice, as vLLM does), so the
    tokens are not TP=1's; measured 2026-11-27 on the dev machine: 355/384
    (92.4%) against 356/384 at TP=1. The bound is TP=1's."""
    from tests.support.fp8_agreement import fp8_agreement

    agreed, n = fp8_agreement("cpu", tensor_parallel_size=3)
    assert agreed >= 0.88 * n


def test_the_skinny_fp8_gemm_takes_narrower_tiles_where_shared_memory_is_short():
    """64-channel tiles over 4 stages need 120 KiB of shared memory a block:
    Hopper has 227 KiB, Ada (L40S, RTX 4090) 99 KiB, which gets 32 over 3."""
    from tandem.kernels.fp8_triton import HOPPER_SHARED_MEMORY, _few_rows_tile, few_rows_tile

    assert few_rows_tile(HOPPER_SHARED_MEMORY) == (64, 4)
    assert few_rows_tile(101376) == (32, 3)
    assert _few_rows_tile(torch.device("cpu")) == (64, 4)  # Triton's interpreter: the Hopper tile

