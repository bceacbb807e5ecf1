"""Architecture presets for benchmarks with dummy (random) weights: real
shapes, no download. Values from the models' published configs.

    python -m tandem.bench.presets llama-3-8b DIR --tokenizer smollm2

writes DIR/config.json (a model folder that engines serve with
--load-format dummy) and, with --tokenizer, DIR/tokenizer/ (for --tokenizer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional


def preset_config(name: str) -> Any:
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if name == "llama-3-8b":
        return LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
            bos_token_id=128000, eos_token_id=128001)
    if name == "llama-3-tiny":
        # Llama-3's vocabulary and rope with toy widths: the CPU stand-in that
        # rehearses a llama-3-8b benchmark's plumbing.
        return LlamaConfig(
            vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
            bos_token_id=128000, eos_token_id=128001)
    if name == "qwen3-0.6b":
        return Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
            bos_token_id=151643, eos_token_id=151645)
    if name == "qwen3-30b-a3b":
        # 30.5B parameters, 3.3B active per token: 128 experts, top-8, in every layer.
        return Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
    raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")


PRESETS = ("llama-3-8b", "llama-3-tiny", "qwen3-0.6b", "qwen3-30b-a3b")
# Engine flags a benchmark with --preset ignores: the preset is the model.
PRESET_DECIDES = ("model", "load_format")


def with_preset(engine_args: Any, preset: Optional[str]) -> Any:
    """`engine_args` running the dummy weights of `preset` (its name is the
    model id), or unchanged without one."""
    if not preset:
        return engine_args
    import dataclasses

    return dataclasses.replace(engine_args, model=preset, load_format="dummy",
                               hf_config=preset_config(preset))
PLACEHOLDER = "<x{}>"  # the text of a token id the borrowed tokenizer does not have


def save_preset(name: str, folder: str, tokenizer: Optional[str] = None) -> str:
    """Write the preset's config.json into `folder`; with `tokenizer` (a HF
    folder, .gguf file or "smollm2"), also `folder/tokenizer/`, padded to the
    model's vocabulary. Returns `folder`.

    Padding: a dummy-weight model samples any id below its vocab_size, and a
    borrowed tokenizer with a smaller vocabulary would decode the rest to no
    text at all, so a streamed answer could show nothing for many tokens (and
    TTFT, measured at the first text, would be wrong). Every missing id
    decodes to the placeholder "<xID>" instead; prompts encode as before.
    """
    config = preset_config(name)
    config.save_pretrained(folder)
    if tokenizer is not None:
        from tandem.engine.loader import load_model_info

        tok = load_model_info(folder, load_format="dummy", hf_config=config, tokenizer=tokenizer).tokenizer
        if tok is None:
            raise ValueError(f"no tokenizer found at {tokenizer!r}")
        tok_dir = os.path.join(folder, "tokenizer")
        tok.save_pretrained(tok_dir)
        pad_vocab(os.path.join(tok_dir, "tokenizer.json"), config.vocab_size)
    return folder


def pad_vocab(tokenizer_json: str, vocab_size: int) -> int:
    """Give every id in [len(vocab), vocab_size) a placeholder token in a BPE
    tokenizer.json (no merges make them, so encoding is unchanged). Returns
    how many were added."""
    with open(tokenizer_json) as f:
        data = json.load(f)
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"can only pad BPE tokenizers, not {model.get('type')}")
    vocab = model["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    added = 0
    for i in range(vocab_size):
        if i not in taken:
            vocab[PLACEHOLDER.format(i)] = i
            added += 1
    with open(tokenizer_json, "w") as f:
        json.dump(data, f, ensure_ascii=False)
    return added


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.presets",
                                description="Write a preset as a model folder for --load-format dummy.")
    p.add_argument("preset", choices=PRESETS)
    p.add_argument("folder")
    p.add_argument("--tokenizer", default=None,
                   help="also write FOLDER/tokenizer from this HF folder, .gguf file or 'smollm2', "
                        "padded to the preset's vocabulary")
    args = p.parse_args(argv)
    save_preset(args.preset, args.folder, args.tokenizer)
    print(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
