"""FP8 greedy agreement with the bf16 engine on the real embedded model
(SmolLM2-135M-Instruct): issue 19's ">= 97% of greedy tokens", on the CPU
(tests/unit/test_fp8.py, the dequantizing twin) and on a GPU
(tests/gpu/test_fp8_gpu.py, the FP8 GEMM); the same measure for an FP8 KV
cache (--kv-cache-dtype fp8) in tests/unit/test_fp8_kv_cache.py.

Teacher forced, as tests/support/bf16_agreement.py: the bf16 engine's greedy
continuation of each prompt is the history; at every position the FP8 engine
(quantized at load) picks one token after the same history, and agreement is
the share it picks the bf16 engine's token.
"""
from __future__ import annotations

import functools

from tandem.engine import LLM, SamplingParams
from tests.support.bf16_agreement import NEW_TOKENS, QUESTIONS, TEXT


def fp8_agreement(device: str, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """(positions where FP8 weights pick bf16's token, positions); tensor_parallel_size:
    the FP8 engine's (the bf16 one is whole)."""
    return agreement_with_bf16(device, "FP8", quantization="fp8", tensor_parallel_size=tensor_parallel_size)


def agreement_with_bf16(device: str, label: str, **engine_kwargs) -> tuple[int, int]:
    """(positions where the bf16 engine given engine_kwargs, e.g.
    kv_cache_dtype="fp8", picks the plain bf16 engine's token, positions)."""
    histories, expected = _bf16_reference(device)
    llm = LLM("smollm2", device=device, dtype="bfloat16", num_blocks=4096, **engine_kwargs)
    try:
        outs = llm.generate(histories, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        llm.shutdown()
    agreed = sum(o.outputs[0].token_ids[0] == e for o, e in zip(outs, expected))
    print(f"{label} agreement with bf16 on SmolLM2 ({device}, {engine_kwargs}): {agreed}/{len(expected)} "
          f"({agreed / len(expected):.1%})")
    return agreed, len(expected)


@functools.lru_cache(maxsize=2)
def _bf16_reference(device: str) -> tuple[list[list[int]], list[int]]:
    """The bf16 engine's greedy continuations as teacher-forced positions:
    (every prefix, the token bf16 chose after it); once per device a session."""
    reference = LLM("smollm2", device=device, dtype="bfloat16", num_blocks=1024)
    tok = reference.tokenizer
    ids = tok(TEXT * 12)["input_ids"]
    prompts = [ids[:n] for n in (5, 17, 33, 64, 150, 300)]
    prompts += [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False))["input_ids"] for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    del reference
    histories, expected = [], []
    for p, ref in zip(prompts, continuations):
        for t in range(len(ref)):
            histories.append(p + list(ref[:t]))
            expected.append(ref[t])
    return histories, expected
