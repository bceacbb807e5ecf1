"""Mixture-of-experts MLPs for Qwen3-MoE and Mixtral, around llama.py's
attention and decoder layer.

A sparse layer's MLP is a router (`mlp.gate`, a linear map to one logit per
expert) and the experts as stacked tensors (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]): the names and layout of HF
transformers 5's modules, for both models. Checkpoints, HF's save_pretrained
and the Hub's alike, store each expert apart and Mixtral's under another
name; checkpoint_pieces says which checkpoint tensors fill which part of a
parameter.

Routing, as HF computes it for both: softmax over all experts in fp32, the
top k, renormalised to sum to 1 (Qwen3-MoE only when norm_topk_prob; for
Mixtral this equals a softmax over the top k logits). Qwen3-MoE rounds the
weights to the activation dtype, Mixtral keeps them in fp32.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from tandem.engine.models.llama import MLP
from tandem.engine.tensor_parallel import all_reduce, shard_size
from tandem.kernels import fused_moe, moe_route

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")

# Each expert's projections as checkpoints name them: (gate, up, down).
_EXPERT_PROJ_NAMES = {"mlp": ("gate_proj", "up_proj", "down_proj"),  # Qwen3-MoE
                      "block_sparse_moe": ("w1", "w3", "w2")}  # Mixtral
_MOE_PARAM = re.compile(r"(?P<layer>.+)\.mlp\.(?P<rest>gate\.weight|experts\.(gate_up|down)_proj(?P<scale>_scale)?)")

# (index into a parameter, checkpoint tensor name): the tensor is copied into param[index]
Piece = tuple[tuple, str]


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # scale the top-k weights to sum to 1
    weights_in_activation_dtype: bool  # round the routing weights before they scale the outputs

    @classmethod
    def from_hf(cls, config) -> "MoEConfig":
        if config.model_type == "qwen3_moe":
            return cls(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob), weights_in_activation_dtype=True)
        if config.model_type == "mixtral":
            return cls(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       renormalize=True, weights_in_activation_dtype=False)
        raise ValueError(f"model_type {config.model_type!r} has no mixture of experts; "
                         f"those that do: {', '.join(MOE_MODEL_TYPES)}")


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Qwen3-MoE: every decoder_sparse_step-th layer (counting from 1), except
    those in mlp_only_layers, which keep a dense MLP. Mixtral: every layer."""
    if config.model_type != "qwen3_moe":
        return True
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = getattr(config, "mlp_only_layers", None) or []
    return config.num_experts > 0 and layer_idx not in dense and (layer_idx + 1) % step == 0


def moe_or_dense_mlp(config, layer_idx: int) -> nn.Module:
    """The MLPFactory of the MoE models (llama.py)."""
    if is_sparse_layer(config, layer_idx):
        return SparseMoeBlock(config.hidden_size, MoEConfig.from_hf(config))
    return MLP(config)


def route(router_logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E]."""
    weights_dtype = router_logits.dtype if moe.weights_in_activation_dtype else torch.float32
    return moe_route(router_logits, moe.top_k, moe.renormalize, weights_dtype)


class Experts(nn.Module):
    """Every expert's SwiGLU MLP, stacked: gate_up_proj [E, 2I, H] holds
    expert e's gate rows, then its up rows; down_proj [E, H, I].

    Tensor parallelism splits I: rank r of n keeps gate rows and up rows
    [r * I/n, (r + 1) * I/n) of every expert and the same columns of
    down_proj (intermediate_size is then the rank's I/n; the loader's
    tp_shard narrows each checkpoint tensor), runs the same kernel over
    every expert, and the block sums its output over ranks. Every rank
    routes every token (the router is whole), so no token moves between
    ranks; each expert's GEMMs are 1/n as wide.

    FP8 experts (engine/fp8.py) hold e4m3 tensors of the same shapes and fp32
    scales per expert and output channel: gate_up_proj_scale [E, 2I],
    down_proj_scale [E, H]; None otherwise."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_parameter("gate_up_proj_scale", None)
        self.register_parameter("down_proj_scale", None)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, hidden_size, shard_size(moe.intermediate_size, "expert MLP channels"))

    def fuse(self) -> None:
        """Nothing to merge: gate and up are one stacked tensor already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe)
        e = self.experts
        return all_reduce(fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, e.gate_up_proj_scale,
                                    e.down_proj_scale))


def checkpoint_pieces(name: str, shape: torch.Size) -> Iterator[list[Piece]]:
    """The ways a checkpoint may store MoE parameter `name` (of `shape`), each
    a list of pieces; the loader takes the first whose tensors are all there.
    Nothing for a parameter that is not an MoE router or expert tensor.

    Experts are copied one by one into the stacked tensor, so loading never
    holds a second copy of a layer's experts. FP8 experts' scales come from
    each expert's `weight_scale` (per channel once engine/fp8.py's
    normalize_checkpoint has read the checkpoint)."""
    m = _MOE_PARAM.fullmatch(name)
    if m is None:
        return
    layer, rest = m["layer"], m["rest"]
    suffix = "weight_scale" if m["scale"] else "weight"
    for block, (gate, up, down) in _EXPERT_PROJ_NAMES.items():
        base = f"{layer}.{block}"
        if rest == "gate.weight":
            yield [((), f"{base}.gate.weight")]
        elif rest.startswith("experts.down_proj"):
            yield [((e,), f"{base}.experts.{e}.{down}.{suffix}") for e in range(shape[0])]
        else:
            inter = shape[1] // 2
            yield [piece for e in range(shape[0])
                   for piece in (((e, slice(0, inter)), f"{base}.experts.{e}.{gate}.{suffix}"),
                                 ((e, slice(inter, 2 * inter)), f"{base}.experts.{e}.{up}.{suffix}"))]
