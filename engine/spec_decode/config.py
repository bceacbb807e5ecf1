"""SpeculativeConfig: vLLM's `speculative_config`, the same keys and defaults.

One flag, `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`
(TANDEM_SPECULATIVE_CONFIG, the Helm value `speculative_config`), as
`vllm serve` takes it, rather than a flag per key: the keys that matter
depend on the method, and users copy these settings between the two servers.
`LLM(speculative_config={...})` takes the same keys as a dict.

Standard library only: the router imports the engine's config.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

METHODS = ("ngram", "draft_model")
# vLLM's defaults of prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Each draft token is one more forward of a draft model per step and one more
# row the target verifies; past a few dozen the acceptance of the last ones is nil.
MAX_SPECULATIVE_TOKENS = 32
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


class SpeculativeConfigError(ValueError):
    """A bad speculative_config; the message says which key and what to give."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: draft tokens proposed per request per step, at most
    model: Optional[str] = None  # draft_model: a HF folder, .gguf file, Hub id or "smollm2"
    prompt_lookup_min: Optional[int] = None  # ngram: shortest suffix looked up
    prompt_lookup_max: Optional[int] = None  # ngram: longest suffix looked up (tried first)
    # No proposals while more requests than this run (None: always propose):
    # in a large batch verifying drafts can cost more than it saves
    # (docs/benchmarks.md: 0.76-1.20x at batch 64 on H100s, by the host's speed).
    disable_by_batch_size: Optional[int] = None
    # tandem's own key: propose only while proposing measures faster than not
    # proposing at this batch size (governor.py); False proposes whenever the
    # proposer finds drafts, as vLLM does.
    adaptive: bool = True

    @property
    def keys(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def to_json(self) -> str:
        return json.dumps(self.keys, sort_keys=True)

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From the flag's JSON text, a dict or an instance; None, "" or
        "null" mean no speculation. Raises SpeculativeConfigError."""
        if isinstance(value, SpeculativeConfig):
            value = value.keys
        if isinstance(value, str):
            if value.strip() in ("", "null", "none"):
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"not valid JSON ({exc}); give an object such as {EXAMPLE}") from None
        if value is None:
            return None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"must be a JSON object such as {EXAMPLE}, got {value!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SpeculativeConfigError(f"unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                                         f"{', '.join(known)}")
        return cls._checked(dict(value))

    @classmethod
    def _checked(cls, v: dict) -> "SpeculativeConfig":
        k = v.get("num_speculative_tokens")
        if k is None:
            raise SpeculativeConfigError(f"num_speculative_tokens is required (e.g. {EXAMPLE})")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"num_speculative_tokens must be an integer from 1 to "
                                         f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        off_above = v.get("disable_by_batch_size")
        if off_above is not None and (isinstance(off_above, bool) or not isinstance(off_above, int)
                                      or off_above < 1):
            raise SpeculativeConfigError(f"disable_by_batch_size must be an integer of at least 1 (no "
                                         f"proposals while more requests run), got {off_above!r}")
        adaptive = v.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise SpeculativeConfigError(f"adaptive must be true (propose only while it measures faster, the "
                                         f"default) or false (always propose), got {adaptive!r}")
        model, method = v.get("model"), v.get("method")
        if model is not None and (not isinstance(model, str) or not model):
            raise SpeculativeConfigError(f"model must be a model name or path, got {model!r}")
        if method is None:  # as vLLM: inferred from the model
            if model is None:
                raise SpeculativeConfigError("give method: 'ngram' (prompt lookup) or 'draft_model' with model")
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise SpeculativeConfigError(f"method {method!r} is not supported; use 'ngram' (prompt lookup) or "
                                         "'draft_model' (a smaller model of the same tokenizer)")
        lo, hi = v.get("prompt_lookup_min"), v.get("prompt_lookup_max")
        if method == "draft_model":
            if model is None:
                raise SpeculativeConfigError("method 'draft_model' needs model: the draft's HF folder, .gguf "
                                             "file or Hub id (same tokenizer as the served model)")
            if lo is not None or hi is not None:
                raise SpeculativeConfigError("prompt_lookup_min/max are for method 'ngram'; drop them for "
                                             "'draft_model'")
            return cls(method, k, model=model, disable_by_batch_size=off_above, adaptive=adaptive)
        if model not in (None, "ngram", "[ngram]"):
            raise SpeculativeConfigError(f"method 'ngram' takes no draft model (got model {model!r}); use "
                                         "method 'draft_model' to speculate with a model")
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise SpeculativeConfigError(f"{name} must be an integer of at least 1, got {n!r}")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise SpeculativeConfigError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        return cls("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi, disable_by_batch_size=off_above,
                   adaptive=adaptive)
