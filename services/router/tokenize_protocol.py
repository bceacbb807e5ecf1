"""vLLM's /tokenize and /detokenize request shapes. Same parsing rules as
openai_protocol.py: strict types, and no field silently dropped (what these
models do not declare goes through the field table, request_fields.py)."""
from __future__ import annotations

from typing import Any, Optional

from tandem.services.router.openai_protocol import ChatMessage, Int32, _Strict


class TokenizeCompletionRequest(_Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False  # the template writes the special tokens it wants
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[Int32]
