"""OpenAI's error JSON as HTTP responses, with a type that says whose fault it was."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from tandem.services.router.openai_protocol import error_body

# An answer sent before the request's body was read: the connection cannot
# carry another request (the rest of the body is still coming), so close it.
CLOSE = {"Connection": "close"}
RETRY = {"Retry-After": "1"}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        type_ = "authentication_error"
    elif status == 429:
        type_ = "rate_limit_error"
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)
