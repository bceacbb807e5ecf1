"""Grammars for structured outputs: the backend interface the engine uses,
and its xgrammar implementation.

Why xgrammar (docs/structured_outputs.md): it is vLLM's default, it compiles
a JSON schema over a 50k-token vocabulary in milliseconds here, keeps its own
cache of compiled grammars, and fills the token bitmasks of a whole batch in
one call on its own threads, outside the GIL. llguidance would fit the same
interface: a backend is `compile`, `matcher`, `fill_bitmasks` and
`accept_tokens`.

A bitmask row holds one bit per vocabulary token (1: allowed), 32 per int32;
TokenMasks applies a step's rows to the logits (xgrammar's kernels), and
`apply_bitmask_torch` is their plain-torch twin, on any device.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from tandem.engine.structured_outputs import StructuredOutputs, StructuredOutputsError

# Cache of compiled grammars per engine (keyed by the grammar's source): enough
# for thousands of distinct schemas of ordinary size.
COMPILED_CACHE_BYTES = 512 * 1024 * 1024


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputs) -> Any: ...

    def matcher(self, compiled: Any) -> Matcher: ...

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None: ...

    def accept_tokens(self, matchers: Sequence[Matcher], token_ids: Sequence[int]) -> list[bool]: ...


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask rows [B, W] -> bool [B, vocab_size] (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The plain-torch twin of xgrammar's kernels: logits[r] = -inf where
    bitmask[r] forbids the token, for each r in rows; in place, on the
    logits' device."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # every row constrained (rows are unique): no gather
        logits.masked_fill_(~allowed_tokens(bitmask[: len(rows)], logits.shape[1]), float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.long).to(logits.device, non_blocking=True)
    allowed = allowed_tokens(bitmask[index], logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


# Which code applies the masks: "xgrammar" (its C++ kernel on the CPU, its
# Triton kernel on a GPU; the twin where they do not take the logits) or
# "torch" (the twin). On the H100, xgrammar's was 0-0.2 ms a step faster
# (docs/structured_outputs.md).
MASK_KERNEL = os.environ.get("TANDEM_GRAMMAR_MASK_KERNEL", "xgrammar")


@dataclass
class TokenMasks:
    """One step's grammar masks: bitmask rows aligned with the batch's rows
    (CPU int32, one bit per token), filled for `rows` only."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Forbidden tokens' logits -> -inf, in place. xgrammar's kernels
        (C++ on the CPU, CUDA/Triton on a GPU) where they take these logits;
        the torch twin otherwise."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        if MASK_KERNEL == "xgrammar" and logits.dtype in (torch.float32, torch.float16, torch.bfloat16):
            try:
                import xgrammar as xgr

                every_row = len(self.rows) == logits.shape[0]
                xgr.apply_token_bitmask_inplace(logits, bitmask[: logits.shape[0]], vocab_size=logits.shape[1],
                                                indices=None if every_row else self.rows)
                return
            except (ImportError, RuntimeError, ValueError, TypeError):
                pass  # a layout or device the kernels do not take
        apply_bitmask_torch(logits, bitmask, self.rows)


def _choice_ebnf(choices: Sequence[str]) -> str:
    # JSON string syntax is what xgrammar's EBNF literals take: quotes and
    # backslashes escaped; other characters (UTF-8 included) as they are.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(spec: StructuredOutputs):
    """The xgrammar Grammar of a constraint (no tokenizer needed), or
    StructuredOutputsError naming the field when the constraint does not parse."""
    import xgrammar as xgr

    kind, name = spec.kind, spec.field_name
    try:
        if kind == "json":
            # Compact JSON: a grammar that allows any whitespace lets a small
            # model fill max_tokens with newlines and never close the object.
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError with a parser message
        what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex",
                "choice": "choice", "grammar": "EBNF grammar"}[kind]
        raise StructuredOutputsError(f"{name}: the {what} is not supported or does not parse: "
                                     f"{_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:83: ")."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return repr(exc)
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int = min(4, os.cpu_count() or 1)) -> None:
        """vocab_size: the model's logits width (may exceed the tokenizer's).
        stop_token_ids: what ends a finished grammar; the engine's EOS, so that
        a grammar that completes also finishes the request by the EOS rule."""
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                             cache_limit_bytes=COMPILED_CACHE_BYTES)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def compile(self, spec: StructuredOutputs) -> Any:
        try:
            return self._compile(spec)
        except Exception:
            _grammar(spec)  # raises the error that names the field, where the source is at fault
            raise

    def _compile(self, spec: StructuredOutputs) -> Any:
        kind, source = spec.source()
        if kind == "json":
            # The compiler caches by its input: the canonical text shares one
            # compiled grammar among equal schemas spaced differently.
            return self._compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return self._compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self._compiler.compile_regex(source)
        return self._compiler.compile_grammar(_grammar(spec))

    def matcher(self, compiled: Any) -> Matcher:
        return self._xgr.GrammarMatcher(compiled)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Bitmask row rows[i] := what matchers[i] allows next; one native
        call for the whole batch."""
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))

    def accept_tokens(self, matchers: Sequence[Matcher], token_ids: Sequence[int]) -> list[bool]:
        """Advance each matcher over its token; one native call."""
        return self._batch.batch_accept_token(list(matchers), list(token_ids))


def new_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarBackend:
    if name == "xgrammar":
        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"structured outputs backend must be 'xgrammar', got {name!r}")


def allocate_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """A CPU int32 bitmask, every token allowed. pin: page-locked, so that
    its copy to the GPU is queued without waiting for the GPU."""
    bitmask = torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    return bitmask.pin_memory() if pin else bitmask


__all__ = ["GrammarBackend", "Matcher", "XGrammarBackend", "allocate_bitmask", "allowed_tokens",
           "TokenMasks", "apply_bitmask_torch", "bitmask_width", "new_backend"]
