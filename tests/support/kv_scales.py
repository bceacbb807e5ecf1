"""A checkpoint whose keys and values exceed e4m3's range, with and without
vLLM-style KV cache scales, and the teacher-forced agreement measure the FP8
KV cache tests use (tests/unit/test_fp8_kv_cache.py, tests/gpu)."""
from __future__ import annotations

import torch

from tandem.engine import LLM, SamplingParams
from tests.support.hf_oracle import tiny_model_dir


def large_kv_model(tmp_path, scales: bool) -> str:
    """A tiny Llama whose keys and values are 200x larger and whose queries and
    o_proj are 200x smaller: the same function (attention's logits and output
    are unchanged), but keys and values of several hundred, past e4m3's 448.
    scales: with the checkpoint's k_scale / v_scale (16, vLLM's names)."""
    from safetensors.torch import save_file

    _, hf = tiny_model_dir(tmp_path, "llama")
    with torch.no_grad():
        for layer in hf.model.layers:
            a = layer.self_attn
            a.k_proj.weight.mul_(200.0), a.q_proj.weight.div_(200.0)
            a.v_proj.weight.mul_(200.0), a.o_proj.weight.div_(200.0)
    path = f"{tmp_path}/large-kv-{'scaled' if scales else 'plain'}"
    hf.save_pretrained(path, safe_serialization=True)
    if scales:
        save_file({f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(16.0)
                   for i in range(2) for kind in "kv"}, f"{path}/kv_scales.safetensors")
    return path


def teacher_forced_agreement(path: str, reference: str, **engine_kwargs) -> tuple[int, int, str]:
    """(positions where an engine of path, given engine_kwargs, picks the next
    token the reference engine's greedy continuations have, positions, that
    engine's KV block name)."""
    prompts = [[5 + i, 9, 33, 17, 250, 3, 77, 41, 8, 100 + i] * 3 for i in range(4)]
    same_engine = {k: v for k, v in engine_kwargs.items() if k != "kv_cache_dtype"}  # its cache: the model's dtype
    llm = LLM(reference, num_blocks=256, **same_engine)
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    llm.shutdown()
    histories, expected = [], []
    for prompt, out in zip(prompts, ref):
        tokens = out.outputs[0].token_ids
        histories += [prompt + tokens[:j] for j in range(len(tokens))]
        expected += tokens
    llm = LLM(path, num_blocks=256, **engine_kwargs)
    try:
        outs = llm.generate(histories, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        key = llm.engine.runner.layout.model_key
    finally:
        llm.shutdown()
    return sum(o.outputs[0].token_ids[0] == e for o, e in zip(outs, expected)), len(expected), key
