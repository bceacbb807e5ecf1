"""Architecture presets for benchmarks with dummy (random) weights: real
shapes, no download. Values from the models' published configs."""
from __future__ import annotations

from typing import Any


def preset_config(name: str) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    if name == "llama-3-8b":
        return LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
            bos_token_id=128000, eos_token_id=128001)
    if name == "qwen3-0.6b":
        return Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
            bos_token_id=151643, eos_token_id=151645)
    raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")


PRESETS = ("llama-3-8b", "qwen3-0.6b")
