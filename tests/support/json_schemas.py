"""Fifty JSON schemas of the shapes clients send: ten domains, five shapes
each (flat with required fields; optional fields; a nested object; arrays
with item bounds; enums, patterns and numeric bounds)."""
from __future__ import annotations

from typing import Any

_DOMAINS: dict[str, dict[str, Any]] = {
    # domain -> (a string field, an integer field, a number field, an enum, a nested object's fields)
    "person": {"text": "name", "int": "age", "num": "height_m", "enum": ("role", ["student", "teacher", "engineer"]),
               "nested": ("address", {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})},
    "product": {"text": "title", "int": "stock", "num": "price", "enum": ("category", ["books", "toys", "food"]),
                "nested": ("dimensions", {"width_cm": {"type": "number"}, "height_cm": {"type": "number"}})},
    "order": {"text": "customer", "int": "quantity", "num": "total", "enum": ("status", ["pending", "shipped", "done"]),
              "nested": ("shipping", {"street": {"type": "string"}, "country": {"type": "string"}})},
    "event": {"text": "event_name", "int": "attendees", "num": "duration_h", "enum": ("kind", ["talk", "workshop"]),
              "nested": ("venue", {"hall": {"type": "string"}, "floor": {"type": "integer"}})},
    "book": {"text": "book_title", "int": "pages", "num": "rating", "enum": ("genre", ["fiction", "history", "science"]),
             "nested": ("author", {"first_name": {"type": "string"}, "last_name": {"type": "string"}})},
    "movie": {"text": "movie_title", "int": "year", "num": "score", "enum": ("audience", ["G", "PG", "R"]),
              "nested": ("director", {"name": {"type": "string"}, "born": {"type": "integer"}})},
    "weather": {"text": "city", "int": "humidity", "num": "temperature_c", "enum": ("sky", ["clear", "cloudy", "rain"]),
                "nested": ("wind", {"speed_kmh": {"type": "number"}, "direction": {"type": "string"}})},
    "invoice": {"text": "vendor", "int": "invoice_number", "num": "amount", "enum": ("currency", ["USD", "EUR", "GBP"]),
                "nested": ("billing", {"email": {"type": "string"}, "paid": {"type": "boolean"}})},
    "recipe": {"text": "dish", "int": "servings", "num": "calories", "enum": ("difficulty", ["easy", "medium", "hard"]),
               "nested": ("timing", {"prep_min": {"type": "integer"}, "cook_min": {"type": "integer"}})},
    "flight": {"text": "airline", "int": "seats", "num": "distance_km", "enum": ("cabin", ["economy", "business"]),
               "nested": ("route", {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                    "destination": {"type": "string", "pattern": "^[A-Z]{3}$"}})},
}

# Strings carry a maxLength (and the arrays' integers bounds): a
# 135M-parameter model, greedy, can repeat a word inside an unbounded string,
# or digits inside an unbounded integer, until max_tokens cuts the JSON short.
_TEXT = {"type": "string", "maxLength": 40}


def _shapes(domain: str, d: dict[str, Any]) -> list[dict[str, Any]]:
    text, integer, number = d["text"], d["int"], d["num"]
    enum_name, enum_values = d["enum"]
    nested_name, nested_props = d["nested"]
    flat = {"type": "object", "title": f"{domain} (flat)",
            "properties": {text: _TEXT, integer: {"type": "integer"}, number: {"type": "number"}},
            "required": [text, integer, number], "additionalProperties": False}
    optional = {"type": "object", "title": f"{domain} (optional fields)",
                "properties": {text: _TEXT, integer: {"type": "integer"}, "notes": _TEXT,
                               "verified": {"type": "boolean"}},
                "required": [text]}
    nested = {"type": "object", "title": f"{domain} (nested)",
              "properties": {text: _TEXT,
                             nested_name: {"type": "object", "properties": nested_props,
                                           "required": list(nested_props), "additionalProperties": False}},
              "required": [text, nested_name]}
    arrays = {"type": "object", "title": f"{domain} (arrays)",
              "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "object", "properties": {text: _TEXT, integer: {
                                           "type": "integer", "minimum": 0, "maximum": 100000}},
                                                 "required": [text, integer]}},
                             "labels": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                        "minItems": 2, "maxItems": 4}},
              "required": ["items", "labels"]}
    bounded = {"type": "object", "title": f"{domain} (enums, patterns, bounds)",
               "properties": {enum_name: {"type": "string", "enum": enum_values},
                              integer: {"type": "integer", "minimum": 1, "maximum": 500},
                              number: {"type": "number", "minimum": 0, "maximum": 1000},
                              "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
               "required": [enum_name, integer, number, "code"], "additionalProperties": False}
    return [flat, optional, nested, arrays, bounded]


SCHEMAS: list[dict[str, Any]] = [s for domain, d in _DOMAINS.items() for s in _shapes(domain, d)]
assert len(SCHEMAS) == 50


def prompt_for(schema: dict[str, Any]) -> str:
    return f"Describe a {schema['title'].split(' ')[0]} as a JSON object."
