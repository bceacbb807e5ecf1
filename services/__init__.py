"""tandem's services: router, prefill, decode, kvstore, and what they share (common)."""
