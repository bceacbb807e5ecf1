"""Tool calling: what the model is told about the tools, the grammar that
forces a call, and reading calls back out of the answer.

- tool_choice "required" or a named function: the answer is constrained to
  JSON (a grammar, engine/grammar.py): an array of {"name", "parameters"}
  objects, or the named function's arguments alone. Such an answer always
  parses, and is turned into tool_calls directly.
- tool_choice "auto": the model answers freely and a parser per model family
  finds the calls in its text: Hermes-style `<tool_call>{json}</tool_call>`
  blocks (Qwen2/3, SmolLM2, and any model whose template knows no tools), or
  Llama 3's bare JSON object.
- tool_choice "none": the tools are not shown to the model.

Models whose chat template renders tools itself get them through the
template (`tools=`); for the others (SmolLM2's template ignores tools) the
router writes the tools into the system message in the Hermes convention,
and renders earlier calls and tool results in that convention too.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from tandem.engine.structured_outputs import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def body(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parameters_of(tool) -> dict:
    return tool.function.parameters or NO_PARAMETERS


# --- forcing a call --------------------------------------------------------------------

def forced_constraint(tools: Sequence, tool_choice, parallel: bool) -> Optional[StructuredOutputs]:
    """The grammar of tool_choice "required" or a named function (None for
    "auto"/"none"). Raises ValueError naming tool_choice for an unknown name."""
    if tool_choice == "required":
        calls = {"anyOf": [{"type": "object",
                            "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                           "parameters": parameters_of(t)},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for t in tools]}
        schema = {"type": "array", "items": calls, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema, field_name="tool_choice")
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    tool = named_tool(tools, tool_choice.function.name)
    return StructuredOutputs(json=parameters_of(tool), field_name="tool_choice")


def named_tool(tools: Sequence, name: str):
    for t in tools:
        if t.function.name == name:
            return t
    raise ValueError(f"tool_choice: names the function {name!r}, which is not one of tools "
                     f"({', '.join(t.function.name for t in tools)})")


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls of a constrained answer (finished by the grammar, so it parses)."""
    if tool_choice == "required":
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    return [ToolCall(tool_choice.function.name, text)]


# --- finding calls in a free answer ------------------------------------------------------

class ToolCallParser(Protocol):
    # Where a streamed answer stops being plain content: text from the first
    # of these on is held back until the answer is whole.
    markers: tuple[str, ...]

    def parse(self, text: str, tool_names: set[str]) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls); no calls when the text holds none that parse."""


def _call_of(obj: Any, tool_names: set[str], arguments_key: str = "arguments") -> Optional[ToolCall]:
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    markers = (OPEN,)
    _block = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)

    def parse(self, text: str, tool_names: set[str]) -> tuple[Optional[str], list[ToolCall]]:
        start = text.find(OPEN)
        if start < 0:
            return text, []
        calls = []
        for raw in self._block.findall(text[start:]):
            try:
                call = _call_of(json.loads(raw), tool_names)
            except ValueError:
                call = None
            if call is None:
                return text, []  # a block that is not a call to a known tool: it stays text
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls


class Llama3JsonToolParser:
    """Llama 3.1+: the answer is a JSON object {"name", "parameters"} (or
    several separated by ';'), optionally after <|python_tag|>."""

    markers = ("<|python_tag|>", "{")

    def parse(self, text: str, tool_names: set[str]) -> tuple[Optional[str], list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_of(obj, tool_names, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls


def parser_for(chat_template: Optional[str]) -> ToolCallParser:
    """Llama 3's JSON where the template speaks it (<|python_tag|>), else Hermes."""
    if chat_template and "<|python_tag|>" in chat_template and OPEN not in chat_template:
        return Llama3JsonToolParser()
    return HermesToolParser()


# --- telling the model ----------------------------------------------------------------

def template_knows_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tools_system_text(tools: Sequence[dict]) -> str:
    """The Hermes-convention tool instructions, for templates without tools."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer. The functions, one JSON signature per line:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call one, answer with its name and a JSON object of arguments inside tags, "
            "one block per call:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CLOSE}')


def hermes_messages(messages: list[dict], tools: Optional[Sequence[dict]]) -> list[dict]:
    """Messages for a template that knows no tools: the tools in the system
    message, earlier calls as <tool_call> blocks, tool results as user
    messages in <tool_response> tags. Every content is a string."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])}, ensure_ascii=False)}\n{CLOSE}'
                      for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        message = {"role": role, "content": content}
        if m.get("name") is not None and role == m["role"]:
            message["name"] = m["name"]
        out.append(message)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
