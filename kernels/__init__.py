"""Attention ops over the paged KV cache, and the per-layer ops around them
(RMSNorm with the residual add, rotary embedding, alone or with the KV
cache write, SiLU-and-multiply), and the
fused mixture-of-experts MLP and its routing, and the linear layers (16-bit
and FP8).

Each op has a plain-torch twin (runs on the CPU, and is the oracle for the
Triton kernels in tests) and, on CUDA, a Triton kernel behind the same
signature. `tandem.kernels.ops` picks one.
"""
if __name__ == "kernels":
    # Found as top-level `kernels` with the repository root on sys.path: that
    # name is Hugging Face's package (top_level_name.py says why it matters).
    from .top_level_name import hand_over

    hand_over(__name__, __file__)
else:
    from tandem.kernels.metadata import AttentionMetadata
    from tandem.kernels.ops import (fp8_linear, fused_moe, linear, moe_route, paged_attention, rms_norm,
                                    rotary, rotary_and_write_kv, silu_and_mul, write_kv)

    __all__ = ["AttentionMetadata", "fp8_linear", "fused_moe", "linear", "moe_route", "paged_attention",
               "rms_norm", "rotary", "rotary_and_write_kv", "silu_and_mul", "write_kv"]
