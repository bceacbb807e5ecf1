"""Model code written against the paged attention op. One family covers the
Llama lineage (Llama 2/3, Mistral, SmolLM2, TinyLlama) and Qwen2/Qwen3."""
from tandem.engine.models.llama import LlamaFamilyForCausalLM, SUPPORTED_ARCHITECTURES

__all__ = ["LlamaFamilyForCausalLM", "SUPPORTED_ARCHITECTURES"]
