"""Prompts: what a client sent, turned into token ids (the chat template
applied, then tokenized) and checked against the vocabulary, the context and
the most choices one request may ask for. Pure and synchronous: it runs in
the PromptPool's worker processes (prompts.py). The context limit travels
with each job: it is what the engines report now (engine_reports.py), which
changes as instances come and go.

Errors are InvalidRequest with an OpenAI-style `param`; the APIs turn them
into HTTP 400/404/408/413 or gRPC INVALID_ARGUMENT/NOT_FOUND.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import pydantic

from tandem.services.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                    validation_message)
from tandem.services.router.tool_calls import hermes_messages, template_knows_tools
from tandem.v1 import generate_pb2

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class InvalidRequest(Exception):
    """A request the client must change; raised in worker processes too."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def __reduce__(self):
        # Exceptions pickle only their args by default; a worker's must keep param and status.
        return InvalidRequest, (self.message, self.param, self.status, self.code)


@dataclass
class Prepared:
    """A parsed HTTP request with its bulk (messages or prompts) replaced by
    the token ids: one prompt for a chat, one or more for completions."""

    body: Any  # ChatCompletionRequest or CompletionRequest, messages / prompt emptied
    prompts: list[list[int]]


class Prompter:
    """Body -> token ids. Pure and synchronous: it runs in the pool's workers.
    Each whole-request method gets the context limit of its job."""

    def __init__(self, tokenizer: Any, max_choices: int) -> None:
        self.tokenizer = tokenizer
        self.max_choices = max_choices
        self.vocab_size = len(tokenizer)

    # --- whole requests ---------------------------------------------------------------

    def chat_completion(self, raw: bytes, max_model_len: int) -> Prepared:
        body = _parse(raw, ChatCompletionRequest)
        self._check_choices(1, body.n)
        messages = []
        for m in body.messages:
            message = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        # tool_choice "none": the model is not told of the tools.
        tools = None if not body.tools or body.tool_choice == "none" else [t.model_dump(exclude_none=True)
                                                                          for t in body.tools]
        ids = self.chat(messages, tools)
        return Prepared(body.model_copy(update={"messages": []}),
                        [_fits(ids, "messages", max_model_len)])

    def completion(self, raw: bytes, max_model_len: int) -> Prepared:
        body = _parse(raw, CompletionRequest)
        p = body.prompt
        if not p:
            raise InvalidRequest("prompt: must not be empty", param="prompt")
        many = not isinstance(p, str) and not isinstance(p[0], int)
        # Before tokenizing: a request for 20k prompts is refused in microseconds.
        self._check_choices(len(p) if many else 1, body.n)
        if isinstance(p, str):
            prompts = [_fits(self.text(p), "prompt", max_model_len)]
        elif isinstance(p[0], int):
            prompts = [_fits(self.token_ids(p), "prompt", max_model_len)]
        elif isinstance(p[0], str):
            prompts = [_fits(self.text(s, param=f"prompt[{i}]"), "prompt", max_model_len)
                       for i, s in enumerate(p)]
        else:
            prompts = [_fits(self.token_ids(ids, param=f"prompt[{i}]"), "prompt", max_model_len)
                       for i, ids in enumerate(p)]
        return Prepared(body.model_copy(update={"prompt": []}), prompts)

    def generate(self, raw: bytes, max_model_len: int) -> list[int]:
        """The prompt of a serialized tandem.v1.GenerateRequest (the public gRPC API)."""
        request = generate_pb2.GenerateRequest.FromString(raw)
        self._check_choices(1, request.params.n or 1)
        which = request.WhichOneof("input")
        if which == "prompt":
            return _fits(self.text(request.prompt), "prompt", max_model_len)
        if which == "token_ids":
            return _fits(self.token_ids(request.token_ids.ids, param="token_ids"), "token_ids",
                         max_model_len)
        if which == "chat":
            ids = self.chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
            return _fits(ids, "messages", max_model_len)
        raise InvalidRequest("input: set one of prompt, token_ids or chat", param="input")

    # --- prompts ------------------------------------------------------------------------

    def chat(self, messages: Sequence[dict], tools: Optional[list[dict]] = None) -> list[int]:
        """messages: [{"role": ..., "content": str, "tool_calls"?, "tool_call_id"?}]
        and the tools the model may call -> the templated prompt's token ids."""
        if not messages:
            raise InvalidRequest("messages: must contain at least one message", param="messages")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role: {m.get('role')!r} is not one of "
                                     f"{', '.join(CHAT_ROLES)}", param=f"messages[{i}].role")
            calls_only = m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") is None
            if not isinstance(m.get("content"), str) and not calls_only:
                raise InvalidRequest(f"messages[{i}].content: must be a string",
                                     param=f"messages[{i}].content")
            if m.get("role") == "tool" and not m.get("tool_call_id"):
                raise InvalidRequest(f"messages[{i}].tool_call_id: a tool message answers a call: "
                                     "give the call's id", param=f"messages[{i}].tool_call_id")
        template = getattr(self.tokenizer, "chat_template", None)
        kwargs: dict = {}
        if template_knows_tools(template):
            # The template renders tools, calls and results itself.
            messages = [{k: v for k, v in m.items()} for m in messages]
            for m in messages:
                for call in m.get("tool_calls") or ():
                    # Templates iterate over the arguments: give them the object.
                    call["function"]["arguments"] = _json_or_text(call["function"]["arguments"])
            if tools:
                kwargs["tools"] = tools
        else:
            messages = hermes_messages(list(messages), tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # templates raise on role orders they do not support
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}",
                                 param="messages") from None
        # The template already wrote the special tokens it wants.
        return self.text(text, param="messages", add_special_tokens=False)

    def text(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequest(f"{param}: must not be empty", param=param)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise InvalidRequest(f"{param}: tokenizes to no tokens", param=param)
        return list(ids)

    def token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise InvalidRequest(f"{param}: must contain at least one token", param=param)
        for t in ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequest(f"{param}: token id {t} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", param=param)
        return list(ids)

    def _check_choices(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_choices:
            param = "prompt" if prompts > 1 else "n"
            raise InvalidRequest(
                f"{param}: {prompts} prompt(s) x n={n} ask for {prompts * n} completions; this "
                f"router takes at most {self.max_choices} in one request "
                "(--max-choices-per-request): split the request", param=param)


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _fits(ids: list[int], param: str, max_model_len: int) -> list[int]:
    # Checked here, not only by the frontend, so that a prompt far over the
    # context never travels back to the event loop as a million ids.
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens and the prompt "
            f"has {len(ids)}; shorten the prompt.", param=param, code="context_length_exceeded")
    return ids


def _parse(raw: bytes, kind: type[pydantic.BaseModel]) -> Any:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("The body is not valid UTF-8.") from None
    try:
        return kind.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        message, param = validation_message(exc)
        raise InvalidRequest(message, param=param) from None
