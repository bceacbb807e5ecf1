"""What a request's output must look like: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or an EBNF grammar.

This is plain data that travels with the sampling parameters (HTTP, gRPC,
prefill -> decode); grammar.py turns it into a grammar and a matcher per
request. The canonical `source()` is what compiled grammars are cached by,
so requests with the same constraint share one compiled grammar however
their JSON was spaced.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """The constraint is malformed; the message starts with the field it names."""


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the fields is set (vLLM's StructuredOutputsParams names).

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON
    object; regex: the whole output matches it; choice: the output is one of
    these strings; grammar: an EBNF grammar (xgrammar's dialect, rule `root`)."""

    json: Optional[Any] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    # Where the constraint came from, for error messages: "response_format",
    # "guided_json", "structured_outputs.regex", ... (not part of the identity).
    field_name: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise StructuredOutputsError(f"{self.field_name}: the JSON schema is not valid JSON: "
                                             f"{exc}") from None
        self.validate()

    @property
    def kind(self) -> str:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        return given[0]

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        name = self.field_name
        if len(given) != 1:
            raise StructuredOutputsError(
                f"{name}: give exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, dict):
            raise StructuredOutputsError(f"{name}: a JSON schema must be an object, got "
                                         f"{type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise StructuredOutputsError(f"{name}: the regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise StructuredOutputsError(f"{name}: the grammar must be a non-empty string")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputsError(f"{name}: choice must be a non-empty list of non-empty strings")

    def source(self) -> tuple[str, str]:
        """(kind, canonical text): the cache key of the compiled grammar."""
        kind = self.kind
        if kind == "json":
            # Key order stays: it is the order the model writes the properties in.
            return kind, json.dumps(self.json, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)
