"""The Llama family over the paged KV cache.

Module names mirror HF transformers' (model.layers.N.self_attn.q_proj, ...) so
a HF state dict loads as it is. Differences within the family are three
switches read from the config: biases on q/k/v (Qwen2), RMSNorm on q and k per
head (Qwen3), tied embeddings (SmolLM2, small Qwen). Each layer's MLP comes
from a factory: the dense SwiGLU MLP here, or a mixture of experts
(models/moe.py: Qwen3-MoE, Mixtral) around the same attention.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from tandem.engine.fp8 import Fp8Linear
from tandem.engine.models.linear import Linear
from tandem.engine.models.vocab_parallel import VocabParallelEmbedding
from tandem.engine.tensor_parallel import all_gather_last, all_reduce, shard_size, tp_group, vocab_shard
from tandem.kernels import AttentionMetadata, paged_attention, rms_norm, rotary_and_write_kv, silu_and_mul
from tandem.kernels.kv_cache_dtype import is_fp8

# HF model_type -> (qkv bias, q/k norm); the MoE models get their MLPs from moe.py (models.build_model)
SUPPORTED_ARCHITECTURES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
    "mixtral": (False, False),
}

LayerHook = Callable[[int], None]
# (HF config, layer index) -> that layer's MLP: a module with forward(x) and fuse()
MLPFactory = Callable[[Any, int], nn.Module]


def family_switches(config) -> tuple[bool, bool]:
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[model_type]
    return bool(getattr(config, "attention_bias", qkv_bias)) or qkv_bias, qk_norm


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics whatever the activation dtype, as HF does (kernels/layer_ops_torch.py)
        return rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual = x + residual, then its norm: (normed, residual). One kernel
        on a GPU, where residual is updated in place."""
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling of the config's RoPE variant."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exponents), 1.0
    # Scaled variants (llama3, yarn, ...): transformers' config utilities compute them.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.attention_scaling).to(dtype),
                (emb.sin() * self.attention_scaling).to(dtype))


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        qkv_bias, qk_norm = family_switches(config)
        # This rank's heads (all of them without tensor parallelism): q/k/v are
        # column-parallel, o row-parallel (engine/tensor_parallel.py).
        self.num_heads = shard_size(config.num_attention_heads, "attention heads")
        self.num_kv_heads = shard_size(getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                                       "KV heads")
        self.head_dim = head_dim_of(config)
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.scale = self.head_dim ** -0.5
        # An FP8 KV cache stores k / k_scale and v / v_scale: a checkpoint's
        # scales where it has them (engine/loader.py), else one. Other caches
        # ignore them (cache_scales).
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.qkv_proj: Optional[nn.Linear] = None  # set by fuse()

    def fuse(self) -> None:
        """One matrix product for q, k and v instead of three (same bytes read,
        fewer and larger GEMVs: what a decode step on a GPU is bound by)."""
        self.qkv_proj = _concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, hidden: torch.Tensor):
        if self.qkv_proj is None:
            return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(hidden, cos, sin, kv_cache, meta.slot_mapping)
        return self.output(self.attend(q, k, v, kv_cache, meta))

    # The three parts of forward, apart for the piecewise CUDA graphs
    # (engine/piecewise_graphs.py): project and output have fixed shapes for
    # a given token count, attend depends on the batch's sequences.
    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v [tokens, heads, head_dim] after their norms and the rotary
        embedding; k and v also written to the cache at slot_mapping."""
        n = hidden.shape[0]
        q, k, v = self._qkv(hidden)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # HF's rotate-half convention; one launch with the cache write on GPUs
        q, k = rotary_and_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping, *self.cache_scales(kv_cache))
        return q, k, v

    def cache_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) over this cache: the layer's own over FP8, else ones."""
        return (self.k_scale, self.v_scale) if is_fp8(kv_cache.dtype) else (1.0, 1.0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        k_scale, v_scale = self.cache_scales(kv_cache)
        if k_scale == 1.0 and v_scale == 1.0:
            return paged_attention(q, kv_cache, meta, self.scale, new_kv=(k, v))
        # The cache holds k / k_scale and v / v_scale: the keys' scale goes into
        # the softmax scale, the values' onto the output (attention is linear in
        # V). The new rows themselves are not what the cache holds: not passed.
        return paged_attention(q, kv_cache, meta, self.scale * k_scale).mul_(v_scale)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        n = attended.shape[0]
        return all_reduce(self.o_proj(attended.reshape(n, self.num_heads * self.head_dim)))


def has_kv_scales(model: nn.Module) -> bool:
    """Whether any attention layer of model has KV cache scales other than one."""
    return any(isinstance(m, Attention) and (m.k_scale != 1.0 or m.v_scale != 1.0) for m in model.modules())


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        if bias and tp_group().world_size > 1:
            raise ValueError("--tensor-parallel-size above 1 is not built for MLPs with biases (mlp_bias)")
        intermediate = shard_size(config.intermediate_size, "MLP channels")  # gate/up columns, down rows
        self.gate_proj = Linear(config.hidden_size, intermediate, bias=bias)
        self.up_proj = Linear(config.hidden_size, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, config.hidden_size, bias=bias)
        self.gate_up_proj: Optional[nn.Linear] = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = _concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return all_reduce(self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))
        return all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


def dense_mlp(config, layer_idx: int) -> nn.Module:
    return MLP(config)


def _concat_linears(linears: list[nn.Module]) -> nn.Module:
    first = linears[0]
    if isinstance(first, Fp8Linear):  # an FP8 checkpoint's projections (engine/fp8.py)
        return Fp8Linear.concat(linears)
    fused = Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                   device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, config, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta):
        """(this layer's output, the residual stream before it is added).

        The residual add is folded into the next norm (the same sums, in the
        same dtype, as `hidden + attn(norm(hidden))`), so the last layer's
        output is added by the final norm."""
        q, k, v, residual = self.begin(hidden, residual, cos, sin, kv_cache, meta.slot_mapping)
        return self.finish(self.self_attn.attend(q, k, v, kv_cache, meta), residual)

    def begin(self, hidden, residual, cos, sin, kv_cache, slot_mapping):
        """Up to the attention: (q, k, v, the residual stream)."""
        if residual is None:
            residual = hidden
            h = self.input_layernorm(hidden)
        else:
            h, residual = self.input_layernorm.add_and_norm(hidden, residual)
        return (*self.self_attn.project(h, cos, sin, kv_cache, slot_mapping), residual)

    def finish(self, attended, residual):
        """From the attention's output on: (this layer's output, the residual stream)."""
        h = self.self_attn.output(attended)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, make_mlp: MLPFactory) -> None:
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if tp_group().world_size > 1 else nn.Embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, make_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, config, make_mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        family_switches(config)  # fail early on an unsupported model
        self.config = config
        self.model = LlamaModel(config, make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_size = config.vocab_size
        # This rank's slice of the vocabulary (all of it without tensor parallelism)
        self.lm_head = Linear(config.hidden_size, vocab_shard(config.vocab_size)[1], bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def fuse_projections(self) -> None:
        """Merge q/k/v and gate/up after the weights are loaded under HF's names."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, before_layer: Optional[LayerHook] = None,
                after_layer: Optional[LayerHook] = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flattened batch.

        before_layer(i) runs before layer i reads its cache (a KV connector
        waits there for that layer's loads); after_layer(i) once layer i has
        written its K/V (the connector saves layer by layer, so the transfer
        overlaps the remaining layers).
        """
        hidden, cos, sin = self.embed(input_ids, positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            hidden, residual = layer(hidden, residual, cos, sin, kv_caches[i], meta)
            if after_layer is not None:
                after_layer(i)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(the tokens' embeddings, the rotary embedding's cos and sin at their positions)."""
        hidden = self.model.embed_tokens(input_ids)
        return (hidden, *self.model.rotary_emb.cos_sin(positions, hidden.dtype))

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output added to the residual stream, normed: the hidden states."""
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits in the model's dtype. Not widened to fp32 here:
        greedy rows take their argmax as they are (the same token: widening is
        exact), and the samplers widen what they edit or normalize themselves.
        At batch 256 of a 128k vocabulary the widening was a 131 MB copy, and
        the argmax read twice the bytes: together 0.16 ms of a 12 ms H200
        step, 0.05 ms without them."""
        logits = self.lm_head(hidden)
        if tp_group().world_size > 1:  # every rank's slice, then the padding off
            logits = all_gather_last(logits)[..., :self.vocab_size]
        return logits
