"""Mixture-of-experts models (Qwen3-MoE, Mixtral): tiny random-weight models
saved by HF transformers load as HF saves them and generate what HF
`generate` generates, token for token (fp32, CPU), for a batch of mixed-length
prompts, with small prefill chunks, and from a prefix-cache hit."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.engine import LLM
from tandem.engine.models import build_model
from tandem.engine.models.moe import Experts
from tests.support.hf_oracle import check_against_oracle, hf_greedy, run_greedy, tiny_model_dir

LENGTHS = [1, 5, 17, 33, 64, 150]
MAX_NEW = 16


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny_moe(request, tmp_path_factory):
    path, hf = tiny_model_dir(tmp_path_factory.mktemp("moe"), request.param)
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in LENGTHS]
    refs = [hf_greedy(hf, p, MAX_NEW, eos_token_id=None) for p in prompts]
    return {"path": path, "hf": hf, "prompts": prompts, "refs": refs}


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 40, "long_prefill_token_threshold": 24},
], ids=["plain", "chunked"])
def test_tiny_moe_models_match_hf(tiny_moe, options):
    llm = LLM(tiny_moe["path"], **options)
    check_against_oracle(run_greedy(llm, tiny_moe["prompts"], MAX_NEW), tiny_moe["refs"], exact=False)


def test_tiny_moe_models_match_hf_from_a_prefix_cache_hit(tiny_moe):
    rng = random.Random(3)
    prefix = [rng.randrange(2, 512) for _ in range(40)]  # two full blocks of 16
    prompts = [prefix + [rng.randrange(2, 512) for _ in range(n)] for n in (3, 9)]
    refs = [hf_greedy(tiny_moe["hf"], p, 8, eos_token_id=None) for p in prompts]
    llm = LLM(tiny_moe["path"])
    first = run_greedy(llm, prompts[:1], 8)
    second = run_greedy(llm, prompts[1:], 8)
    check_against_oracle(first + second, refs, exact=False)
    assert second[0].num_cached_tokens == 32


def test_qwen3_moe_sparse_layers_follow_hf():
    # decoder_sparse_step and mlp_only_layers decide which layers have experts, as in HF.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    with torch.device("meta"):
        ours, hf = build_model(config), Qwen3MoeForCausalLM(config)
    ours_params = {n for n, _ in ours.named_parameters()}
    hf_params = {n for n, _ in hf.named_parameters()}
    assert ours_params == hf_params
    assert [hasattr(layer.mlp, "experts") for layer in ours.model.layers] == [False, True, False, False, False, True]


def test_moe_weights_load_per_expert_and_stacked_alike(tiny_moe, tmp_path):
    # HF saves each expert apart (and Mixtral's under block_sparse_moe); a
    # checkpoint of HF's in-memory modules stacks them. Both load the same.
    from safetensors.torch import save_file

    from tandem.engine.loader import ModelSource, load_weights

    save_file({n: p.detach().contiguous() for n, p in tiny_moe["hf"].state_dict().items()},
              str(tmp_path / "model.safetensors"))
    loaded = []
    for folder in (tiny_moe["path"], str(tmp_path)):
        model = build_model(tiny_moe["hf"].config)
        load_weights(model, ModelSource("hf_dir", "m", folder), tiny_moe["hf"].config)
        loaded.append(dict(model.named_parameters()))
    hf_params = dict(tiny_moe["hf"].named_parameters())
    for name, p in loaded[0].items():
        assert torch.equal(p, hf_params[name]), name
        assert torch.equal(p, loaded[1][name]), name


def test_unsupported_model_type_lists_the_moe_models():
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.model_type = "deepseek_v3"
    with pytest.raises(ValueError, match=r"'deepseek_v3' is not supported; supported: .*mixtral.*qwen3_moe"):
        build_model(config)


def test_qwen3_30b_a3b_preset_builds_with_its_published_size():
    from tandem.bench.presets import preset_config

    with torch.device("meta"):
        model = build_model(preset_config("qwen3-30b-a3b"))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * 8 // 128
    assert 30.4e9 < total < 30.6e9 and 3.3e9 < active < 3.4e9


@pytest.mark.timeout(300)
def test_tiny_moe_models_split_across_two_ranks_match_hf(tiny_moe):
    """Tensor parallelism: each rank keeps half of every expert's channels
    (the checkpoint's experts, saved one by one, narrowed as they load) and
    the block's output is summed over the ranks; chunked prefill, so decodes
    and prefill chunks share steps."""
    llm = LLM(tiny_moe["path"], tensor_parallel_size=2, max_num_batched_tokens=40,
              long_prefill_token_threshold=24)
    try:
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        assert experts and all(m.intermediate_size == 16 for m in experts)  # half of each expert's 32
        check_against_oracle(run_greedy(llm, tiny_moe["prompts"], MAX_NEW), tiny_moe["refs"], exact=False)
    finally:
        llm.shutdown()


def test_a_rank_takes_the_same_expert_slices_from_stacked_and_per_expert_checkpoints(monkeypatch):
    from tandem.engine import tensor_parallel
    from tandem.engine.loader import tp_shard

    experts, inter, hidden = 3, 8, 4
    gate, up, down = torch.randn(experts, inter, hidden), torch.randn(experts, inter, hidden), \
        torch.randn(experts, hidden, inter)
    monkeypatch.setattr(tensor_parallel, "_group", tensor_parallel.TPGroup(rank=1, world_size=2))
    stacked = tp_shard("model.layers.0.mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1))
    for e in range(experts):
        assert torch.equal(stacked[e], torch.cat([tp_shard(f"model.layers.0.mlp.experts.{e}.gate_proj.weight", gate[e]),
                                                  tp_shard(f"model.layers.0.mlp.experts.{e}.up_proj.weight", up[e])]))
        assert torch.equal(stacked[e, :inter // 2], gate[e, inter // 2:])  # rank 1: the second half
    stacked = tp_shard("model.layers.0.mlp.experts.down_proj", down)
    for e in range(experts):
        assert torch.equal(stacked[e], tp_shard(f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight", down[e]))
        assert torch.equal(stacked[e], down[e, :, inter // 2:])
    router = torch.randn(experts, hidden)
    assert torch.equal(tp_shard("model.layers.0.mlp.gate.weight", router), router)  # whole on every rank
