"""Model code written against the paged attention op. One family covers the
Llama lineage (Llama 2/3, Mistral, SmolLM2, TinyLlama) and Qwen2/Qwen3; the
mixture-of-experts models (Qwen3-MoE, Mixtral) are the same family with
moe.py's MLPs."""
from tandem.engine.models.llama import LlamaFamilyForCausalLM, SUPPORTED_ARCHITECTURES, family_switches
from tandem.engine.models.moe import MOE_MODEL_TYPES, moe_or_dense_mlp


def build_model(config) -> LlamaFamilyForCausalLM:
    """The model for a HF config, its parameters uninitialised (loader.py
    fills them); an unsupported model_type fails here with the supported list."""
    family_switches(config)
    if getattr(config, "model_type", "") in MOE_MODEL_TYPES:
        return LlamaFamilyForCausalLM(config, make_mlp=moe_or_dense_mlp)
    return LlamaFamilyForCausalLM(config)


__all__ = ["LlamaFamilyForCausalLM", "SUPPORTED_ARCHITECTURES", "build_model"]
