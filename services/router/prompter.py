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

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import pydantic

from tandem.services.router.openai_protocol import (ChatCompletionRequest,
                                                    CompletionRequest, undeclared_fields,
                                                    validation_message)
from tandem.services.router.request_fields import check_field
from tandem.services.router.tokenize_protocol import (DetokenizeRequest, TokenizeChatRequest,
                                                      TokenizeCompletionRequest)
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
    token_strs: Optional[list[str]] = None  # /tokenize with return_token_strs
    text: Optional[str] = None  # /detokenize's answer


@dataclass(frozen=True)
class Template:
    """How a chat becomes a prompt (vLLM's request fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)  # chat_template_kwargs
    add_special_tokens: bool = False  # the template writes the special tokens it wants

    @classmethod
    def of(cls, body: Any) -> "Template":
        if body.continue_final_message and body.add_generation_prompt:
            raise InvalidRequest("continue_final_message: needs add_generation_prompt set to false "
                                 "(the answer continues the last message, it starts no new turn)",
                                 param="continue_final_message")
        return cls(body.add_generation_prompt, body.continue_final_message,
                   dict(body.chat_template_kwargs or {}), body.add_special_tokens)


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
        # tool_choice "none": the model is not told of the tools.
        tools = None if not body.tools or body.tool_choice == "none" else [t.model_dump(exclude_none=True)
                                                                          for t in body.tools]
        ids = self.chat([m.for_template() for m in body.messages], Template.of(body), tools)
        ids = _truncated(ids, body.truncate_prompt_tokens)
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
        special, keep = body.add_special_tokens, body.truncate_prompt_tokens
        if isinstance(p, str):
            prompts = [self.text(p, add_special_tokens=special)]
        elif isinstance(p[0], int):
            prompts = [self.token_ids(p)]
        elif isinstance(p[0], str):
            prompts = [self.text(s, param=f"prompt[{i}]", add_special_tokens=special)
                       for i, s in enumerate(p)]
        else:
            prompts = [self.token_ids(ids, param=f"prompt[{i}]") for i, ids in enumerate(p)]
        prompts = [_fits(_truncated(ids, keep), "prompt", max_model_len) for ids in prompts]
        return Prepared(body.model_copy(update={"prompt": []}), prompts)

    def tokenize(self, raw: bytes, max_model_len: int) -> Prepared:
        """vLLM's /tokenize: a prompt or a chat -> its ids, whatever their number."""
        kind = TokenizeChatRequest if _has_key(raw, "messages") else TokenizeCompletionRequest
        body = _parse(raw, kind)
        if isinstance(body, TokenizeChatRequest):
            ids = self.chat([m.for_template() for m in body.messages], Template.of(body))
            body = body.model_copy(update={"messages": []})
        else:
            ids = list(self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            body = body.model_copy(update={"prompt": ""})
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return Prepared(body, [ids], token_strs=strs)

    def detokenize(self, raw: bytes, max_model_len: int) -> Prepared:
        """vLLM's /detokenize: ids -> text (special tokens kept, as vLLM)."""
        body = _parse(raw, DetokenizeRequest)
        if body.tokens:
            self.token_ids(body.tokens, param="tokens")
        return Prepared(body.model_copy(update={"tokens": []}), [],
                        text=self.tokenizer.decode(body.tokens))

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

    def chat(self, messages: Sequence[dict], template: Template = Template(),
             tools: Optional[list[dict]] = None) -> list[int]:
        """messages: [{"role": ..., "content": str, "name"?, "tool_calls"?, "tool_call_id"?}]
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
        self._check_template_kwargs(template.kwargs)
        chat_template = getattr(self.tokenizer, "chat_template", None)
        kwargs: dict = dict(template.kwargs)
        if template_knows_tools(chat_template):
            # The template renders tools, calls and results itself.
            messages = [dict(m) for m in messages]
            for m in messages:
                for call in m.get("tool_calls") or ():
                    # Templates iterate over the arguments: give them the object.
                    call["function"]["arguments"] = _json_or_text(call["function"]["arguments"])
            if tools:
                kwargs["tools"] = tools
        else:
            messages = hermes_messages([dict(m) for m in messages], tools)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message, tokenize=False, **kwargs)
        except Exception as exc:  # templates raise on role orders they do not support
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}",
                                 param="messages") from None
        return self.text(text, param="messages", add_special_tokens=template.add_special_tokens)

    def _check_template_kwargs(self, kwargs: dict) -> None:
        # They reach the template as variables; one named like an argument of
        # apply_chat_template (tokenize, chat_template, ...) would change what
        # the router does rather than what the template writes.
        taken = {"messages", *inspect.signature(self.tokenizer.apply_chat_template).parameters}
        for key in kwargs:
            if key in taken:
                raise InvalidRequest(f"chat_template_kwargs.{key}: not a template variable this "
                                     "router lets a request set", param=f"chat_template_kwargs.{key}")

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


def _truncated(ids: list[int], keep: Optional[int]) -> list[int]:
    """truncate_prompt_tokens (vLLM): the prompt's last `keep` tokens."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def _has_key(raw: bytes, key: str) -> bool:
    import json

    try:
        body = json.loads(raw)
    except ValueError:
        return False  # _parse says what is wrong with it
    return isinstance(body, dict) and key in body


def _parse(raw: bytes, kind: type[pydantic.BaseModel]) -> Any:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("The body is not valid UTF-8.") from None
    try:
        body = kind.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        message, param = validation_message(exc)
        raise InvalidRequest(message, param=param) from None
    # No field is silently dropped: one the model does not declare passes
    # only where the field table (request_fields.py) allows its value.
    for path, value in undeclared_fields(body):
        if refusal := check_field(path, value):
            raise InvalidRequest(refusal.message, param=refusal.param)
    return body
