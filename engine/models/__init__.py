"""Model code written against the paged attention op. One family covers the
Llama lineage (Llama 2/3, Mistral, SmolLM2, TinyLlama) and Qwen2/Qwen3; the
mixture-of-experts models (Qwen3-MoE, Mixtral) are the same family with
moe.py's MLPs."""
import contextlib
from typing import Iterator

from torch import nn

from tandem.engine.models.llama import LlamaFamilyForCausalLM, SUPPORTED_ARCHITECTURES, family_switches
from tandem.engine.models.moe import MOE_MODEL_TYPES, moe_or_dense_mlp

# What nn.Linear and nn.Embedding call to draw their weights as they are made.
_RANDOM_INITS = ("kaiming_uniform_", "uniform_", "normal_")


def build_model(config) -> LlamaFamilyForCausalLM:
    """The model for a HF config, its parameters uninitialised (loader.py
    fills them); an unsupported model_type fails here with the supported list."""
    family_switches(config)
    with _no_random_init():
        if getattr(config, "model_type", "") in MOE_MODEL_TYPES:
            return LlamaFamilyForCausalLM(config, make_mlp=moe_or_dense_mlp)
        return LlamaFamilyForCausalLM(config)


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """torch's layers draw random weights as they are made, which load_weights
    then overwrites (every parameter, or it fails naming the missing ones):
    0.8 of SmolLM2's 1.0 s build on the dev machine, at every engine start.
    Drawing nothing leaves them as torch.empty made them, as the MoE experts'
    stacked weights already are. The init functions are swapped for the
    build only; a model is built on the engine's thread before it serves."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, _leave_as_is)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def _leave_as_is(tensor, *args, **kwargs):
    return tensor


__all__ = ["LlamaFamilyForCausalLM", "SUPPORTED_ARCHITECTURES", "build_model"]
