"""HF transformers as the oracle: greedy generation with per-step logprobs,
and the rule for comparing the engine's output against it."""
from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass

import torch


@dataclass
class OracleRun:
    tokens: list[int]
    logprobs: list[float]  # of the chosen token
    top5: list[dict[int, float]]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None) -> OracleRun:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=eos_token_id, pad_token_id=0,
                             temperature=None, top_p=None, top_k=None)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs, top5 = [], []
    for step, tok in enumerate(tokens):
        lp = torch.log_softmax(out.logits[step][0].float(), dim=-1)
        logprobs.append(float(lp[tok]))
        v, i = torch.topk(lp, 5)
        top5.append(dict(zip(i.tolist(), v.tolist())))
    return OracleRun(tokens, logprobs, top5)


def compare_with_tie_rule(ours: list[int], our_top5: list[dict[int, float]], ref: OracleRun,
                          exact: bool) -> int:
    """Number of tokens compared. exact=True: every token must match. Otherwise
    (random-weight models) a near tie may flip one token: accept it only when each
    chosen token sits in the other's top-5 with logprobs within 1e-3, and stop there
    (vLLM's rule)."""
    n = min(len(ours), len(ref.tokens))
    assert len(ours) == len(ref.tokens), f"lengths differ: {len(ours)} vs {len(ref.tokens)}"
    for i in range(n):
        if ours[i] == ref.tokens[i]:
            continue
        assert not exact, f"token {i} differs: ours {ours[i]} vs HF {ref.tokens[i]}\nours {ours}\nHF   {ref.tokens}"
        a, b = ours[i], ref.tokens[i]
        assert a in ref.top5[i] and b in our_top5[i], f"token {i}: {a} vs {b} is no near tie"
        assert abs(ref.top5[i][a] - ref.top5[i][b]) < 1e-3, f"token {i}: not a near tie in HF"
        assert abs(our_top5[i][a] - our_top5[i][b]) < 1e-3, f"token {i}: not a near tie in ours"
        return i
    return n


def run_greedy(llm, prompts: list[list[int]], max_new: int):
    """The engine's greedy outputs with top-5 logprobs, past EOS (as hf_greedy with eos_token_id=None)."""
    from tandem.engine import SamplingParams

    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=5, ignore_eos=True))


def check_against_oracle(outputs, refs: list[OracleRun], exact: bool) -> None:
    """Tokens by compare_with_tie_rule; the chosen tokens' logprobs within 1e-4."""
    import pytest

    for out, ref in zip(outputs, refs):
        c = out.outputs[0]
        ours_top5 = [lp.top for lp in c.logprobs]
        n = compare_with_tie_rule(c.token_ids, ours_top5, ref, exact=exact)
        ours_lp = [lp.logprob for lp in c.logprobs[:n]]
        assert ours_lp == pytest.approx(ref.logprobs[:n], abs=1e-4)


def tiny_model_dir(tmp_path, arch: str, seed: int = 0, lm_head_scale: float = 1.0,
                   vocab_size: int = 512, **overrides) -> tuple[str, object]:
    """Save a tiny random-weight Llama, Qwen3, Qwen3-MoE or Mixtral as a HF
    folder; return (path, HF model).

    The MoE models have 8 experts, top-2; Qwen3-MoE's middle layer keeps a
    dense MLP (mlp_only_layers), as some of its configs have. vocab_size:
    SmolLM2's 49152 makes a (useless) draft model for it. overrides: other
    config fields (e.g. num_attention_heads=8 for tensor parallelism)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.3,
                  eos_token_id=1, bos_token_id=0, pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        config = LlamaConfig(**common)
        model = LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = Qwen3Config(head_dim=32, **common)
        model = Qwen3ForCausalLM(config)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, **{**common, "num_hidden_layers": 3}, mlp_only_layers=[1])
        model = Qwen3MoeForCausalLM(config)
    elif arch == "mixtral":
        config = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **{**common, "intermediate_size": 32})
        model = MixtralForCausalLM(config)
    else:
        raise ValueError(arch)
    model = model.float().eval()
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    path = os.path.join(str(tmp_path), arch)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def embedded_hf_model():
    """HF transformers' own SmolLM2-135M-Instruct (fp32) and tokenizer, read from
    the embedded GGUF file itself: the engine reads the folder that file was
    converted into (engine/gguf_cache.py), so the conversion is tested too.
    A fresh model each call (callers may cast or move it); what it is built
    from is read from the file once per test session (about 16 s on dev)."""
    from transformers import AutoModelForCausalLM

    config, state, tokenizer = _embedded_hf_parts()
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config)).float().eval()
    hf.load_state_dict(state, strict=False)  # copies: the cached tensors stay as read
    hf.tie_weights()
    return hf, tokenizer


@functools.lru_cache(maxsize=1)
def _embedded_hf_parts():
    from transformers import AutoConfig, AutoTokenizer

    from tandem.engine.loader import embedded_gguf_path, gguf_parsed_once, gguf_state_dict

    path = embedded_gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    with gguf_parsed_once():  # the file parsed once for all three
        return (AutoConfig.from_pretrained(folder, gguf_file=name), gguf_state_dict(path),
                AutoTokenizer.from_pretrained(folder, gguf_file=name))
