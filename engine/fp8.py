"""FP8 weights: e4m3 linear layers with one scale per output channel and
per-token activation scales computed on the fly, but for steps of one token,
which multiply unquantized activations (kernels/fp8_torch.py has
the arithmetic).

Two ways in, one form in memory:
- `--quantization fp8` quantizes a bf16 checkpoint (or dummy weights) as it
  loads: every linear layer of the decoder blocks; the embedding, the norms
  and the LM head stay in the model dtype, as vLLM leaves them.
- A HF FP8 checkpoint (config.quantization_config.quant_method == "fp8") is
  read as it is: per-tensor scales (`weight_scale`, one number: AutoFP8 /
  llm-compressor's "fp8" format) and per-channel ones load exactly; block-wise
  scales (`weight_scale_inv` with `weight_block_size`: Qwen3-FP8, DeepSeek)
  are dequantized in fp32 and quantized again per channel, a second rounding
  of each weight. Static activation scales (`input_scale`) are not used: each
  token gets its own dynamic scale, which never clips.

Every form ends as Fp8Linear's per-channel scales, so fused projections
(q/k/v, gate/up) concatenate scales as they concatenate rows.
Mixture-of-experts models get the same for their experts: the stacked expert
tensors (models/moe.py) become e4m3 with a scale per expert and output
channel, and the fused MoE kernel reads them (kernels/fused_moe_triton.py);
the router stays in the model dtype, as in the Hub's FP8 MoE checkpoints.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from tandem.engine.config import ConfigError
from tandem.kernels import fp8_linear
from tandem.kernels.fp8_torch import FP8_DTYPE, quantize_stacked, quantize_weight

log = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
DEFAULT_WEIGHT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default


class QuantizationError(ConfigError):
    """A quantization this model, checkpoint or device cannot have; the
    message names the flag and says what is supported (commands print it as
    `error: ...`, status 2)."""


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in e4m3 [out, in] and fp32 scales [out]. The
    weight and scales are parameters (without gradients) so that checkpoints
    load into them by name and weight byte counts see them."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 device: Optional[torch.device] = None, bias_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # The CPU twin's fp32 copy of the e4m3 values, made at the first call
        # (after loading): converting them at every step would dominate it.
        self._weight_fp32: Optional[torch.Tensor] = None

    @classmethod
    def shell_of(cls, linear: nn.Linear) -> "Fp8Linear":
        """An Fp8Linear of `linear`'s shape for a checkpoint to fill."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None,
                   device=linear.weight.device, bias_dtype=linear.weight.dtype)

    @classmethod
    def quantized(cls, linear: nn.Linear) -> "Fp8Linear":
        out = cls.shell_of(linear)
        with torch.no_grad():
            q, scale = quantize_weight(linear.weight)
            out.weight.copy_(q)
            out.weight_scale.copy_(scale)
            if linear.bias is not None:
                out.bias.copy_(linear.bias)
        return out

    @classmethod
    def concat(cls, parts: list["Fp8Linear"]) -> "Fp8Linear":
        """One layer whose outputs are the parts' outputs side by side (fused
        q/k/v, gate/up): rows and their scales stack."""
        first = parts[0]
        out = cls(first.in_features, sum(p.out_features for p in parts), first.bias is not None,
                  device=first.weight.device, bias_dtype=None if first.bias is None else first.bias.dtype)
        with torch.no_grad():
            out.weight.copy_(torch.cat([p.weight for p in parts]))
            out.weight_scale.copy_(torch.cat([p.weight_scale for p in parts]))
            if first.bias is not None:
                out.bias.copy_(torch.cat([p.bias for p in parts]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        weight_fp32 = None
        if not x.is_cuda:
            if self._weight_fp32 is None:
                self._weight_fp32 = self.weight.float()
            weight_fp32 = self._weight_fp32
        out = fp8_linear(x2, self.weight, self.weight_scale, self.bias, weight_fp32)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def checkpoint_quantization(hf_config: Any) -> Optional[str]:
    """"fp8" for a HF FP8 checkpoint, None for an unquantized one; any other
    quantization method is refused here, before a byte of it is read."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = (qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None))
    method = getattr(method, "value", method)  # transformers keeps it as an enum
    if method in QUANTIZATIONS:
        return method
    raise QuantizationError(
        f"--model: the checkpoint is quantized with {method!r}, which tandem cannot load; it loads FP8 "
        f"checkpoints (quant_method 'fp8') and unquantized ones (--quantization fp8 quantizes "
        f"those at load)")


def weight_block_size(hf_config: Any) -> tuple[int, int]:
    qc = getattr(hf_config, "quantization_config", None) or {}
    block = qc.get("weight_block_size") if isinstance(qc, dict) else getattr(qc, "weight_block_size", None)
    return tuple(block) if block else DEFAULT_WEIGHT_BLOCK


def effective_quantization(hf_config: Any, requested: Optional[str], device: torch.device) -> Optional[str]:
    """What the engine runs: the flag's quantization, else the checkpoint's.
    Raises QuantizationError for a model or device that cannot have it."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {requested!r}: supported: {', '.join(QUANTIZATIONS)}")
    method = requested or checkpoint_quantization(hf_config)
    if method is None:
        return None
    flag = "--quantization fp8" if requested else "--model (an FP8 checkpoint)"
    too_old = gpu_without_fp8(device)
    if too_old:
        raise QuantizationError(
            f"{flag}: FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for its FP8 "
            f"matrix products; this one is {too_old}: serve a bf16 checkpoint without --quantization")
    return method


def gpu_without_fp8(device: torch.device) -> Optional[str]:
    """The compute capability ("8.0") of a CUDA device below 8.9, where
    e4m3 has no hardware conversions or products; None for any other device."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return None
    return "%d.%d" % torch.cuda.get_device_capability(device)


def normalize_checkpoint(state: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A new state dict in which every e4m3 `X.weight` has per-channel fp32
    `X.weight_scale` [out] (see the module docstring for each source form);
    the input tensors are not modified."""
    out = dict(state)
    ignored_input_scales = 0
    for key, tensor in state.items():
        if key.endswith(".input_scale"):
            del out[key]
            ignored_input_scales += 1
            continue
        if not key.endswith(".weight") or tensor.dtype != FP8_DTYPE:
            continue
        base = key[:-len(".weight")]
        rows = tensor.shape[0]
        if base + ".weight_scale_inv" in state:
            scale = state[base + ".weight_scale_inv"].float()
            full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :tensor.shape[1]]
            out[key], out[base + ".weight_scale"] = quantize_weight(tensor.float() * full)
            del out[base + ".weight_scale_inv"]
        elif base + ".weight_scale" in state:
            scale = state[base + ".weight_scale"].float().reshape(-1)
            if scale.numel() not in (1, rows):
                raise QuantizationError(f"{base}.weight_scale has {scale.numel()} values; per-tensor (1) "
                                        f"or per-channel ({rows}) scales load, others do not")
            out[base + ".weight_scale"] = scale.expand(rows).contiguous()
        else:
            raise QuantizationError(f"{key} is FP8 but the checkpoint has no {base}.weight_scale or "
                                    f"{base}.weight_scale_inv")
    if ignored_input_scales:
        log.info("FP8 checkpoint: %d static activation scales (input_scale) not used; activations get "
                 "dynamic per-token scales", ignored_input_scales)
    return out


def replace_linears(model: nn.Module, make: Any, only: Optional[set[str]] = None) -> int:
    """Replace the nn.Linear modules of the decoder blocks (named as in the
    model: model.layers.N.self_attn.q_proj) with make(linear), but MoE
    routers; only: just these names. Returns how many were replaced."""
    from tandem.engine.models.moe import SparseMoeBlock

    # A router's logits pick the experts: rounding them would change which run.
    routers = {f"{name}.gate" for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not name.startswith("model.layers.") or name in routers:
            continue
        if only is not None and name not in only:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, make(module))
        count += 1
    return count


def _experts(model: nn.Module) -> list[nn.Module]:
    from tandem.engine.models.moe import Experts

    return [m for m in model.modules() if isinstance(m, Experts)]


def _set_fp8_experts(experts: nn.Module, weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> None:
    for name in ("gate_up_proj", "down_proj"):
        setattr(experts, name, nn.Parameter(weights[name], requires_grad=False))
        setattr(experts, name + "_scale", nn.Parameter(scales[name], requires_grad=False))


def quantize_experts(experts: nn.Module) -> None:
    """One MoE layer's stacked experts [E, N, K] to e4m3 with fp32 scales
    [E, N] (kernels/fp8_torch.py's quantize_stacked)."""
    weights, scales = {}, {}
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            weights[name], scales[name] = quantize_stacked(getattr(experts, name))
    _set_fp8_experts(experts, weights, scales)


def fp8_expert_shells(model: nn.Module) -> int:
    """Make every MoE layer's experts e4m3 (zeros) with scales for an FP8
    checkpoint to fill; returns how many layers."""
    layers = _experts(model)
    for experts in layers:
        weights = {n: torch.zeros_like(getattr(experts, n), dtype=FP8_DTYPE) for n in ("gate_up_proj", "down_proj")}
        scales = {n: torch.ones(w.shape[:2], dtype=torch.float32, device=w.device) for n, w in weights.items()}
        _set_fp8_experts(experts, weights, scales)
    return len(layers)


def quantize_model(model: nn.Module) -> int:
    """Quantize every remaining bf16 linear layer of the decoder blocks, and
    every MoE layer's experts."""
    count = replace_linears(model, Fp8Linear.quantized)
    layers = [e for e in _experts(model) if e.gate_up_proj_scale is None]
    for experts in layers:
        quantize_experts(experts)
    log.info("quantized %d linear layers%s to FP8 (e4m3, per-channel weight scales)", count,
             f" and the experts of {len(layers)} MoE layers" if layers else "")
    return count + len(layers)


def fp8_linear_names(state: dict[str, torch.Tensor]) -> set[str]:
    """The modules whose checkpoint weight is e4m3."""
    return {k[:-len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE}


def is_quantized(model: nn.Module) -> bool:
    return (any(isinstance(m, Fp8Linear) for m in model.modules())
            or any(e.gate_up_proj_scale is not None for e in _experts(model)))


__all__ = ["Fp8Linear", "QuantizationError", "QUANTIZATIONS", "checkpoint_quantization", "effective_quantization",
           "fp8_expert_shells", "fp8_linear_names", "is_quantized", "normalize_checkpoint", "quantize_experts",
           "quantize_model", "replace_linears", "weight_block_size"]
