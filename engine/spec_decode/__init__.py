"""Speculative decoding: cheap proposals of the next tokens, verified by the
target model in one step (docs/architecture.md, "Speculative decoding").

- config.py: SpeculativeConfig, vLLM's `speculative_config` (no torch: the
  router imports the engine's config);
- ngram_proposer.py: prompt lookup, the last n tokens found earlier in the
  sequence propose what followed them there;
- draft_proposer.py: a smaller model of the same tokenizer over its own
  paged KV cache, kept in step with the target's accepted tokens;
- rejection_sampler.py: keeps what the target would have sampled (greedy:
  the argmax; sampled: accept/reject with the residual distribution);
- speculator.py: the engine's side: which requests speculate, how many
  tokens each, the proposer's per-request state.

This package's __init__ imports nothing, so that config.py stays torch-free.
"""
