"""HTTP errors of the gateway: the `ApiError` exception and OpenAI-style error bodies.

Every refusal the gateway sends has the body OpenAI clients expect:
`{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}`.
Handlers raise `ApiError`; the app turns it into a response. Helpers here translate the
two other sources of refusals: msgspec decode failures and the engine's `GenerationError`.
"""

from __future__ import annotations

import re

import msgspec

from actors.frontends.base import ERR_ENGINE_STOPPED, GenerationError
from actors.tokenizer.validation import ERR_CONTEXT_LENGTH, ERR_INVALID_REQUEST, ERR_OVERLOADED
from transport.messages.sessions import (
    ERR_SESSION_BUSY,
    ERR_SESSION_LIMIT,
    ERR_SESSION_NOT_FOUND,
)

# OpenAI error "type" values.
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class ErrorDetail(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    """A refusal with an HTTP status; `headers` are added to the response (e.g. Allow)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or []

    def body(self, api: str = "openai") -> bytes:
        """The error body in the shape of the API the request spoke."""
        if api == "anthropic":
            return msgspec.json.encode(anthropic_error(self))
        return msgspec.json.encode(ErrorBody(error=self.detail))


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(error: ApiError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, as the Messages API answers."""
    kind = _ANTHROPIC_TYPES.get(error.status)
    if kind is None:
        kind = "invalid_request_error" if error.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": error.detail.message}}


_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_FIELD_PREFIX = re.compile(r"^([a-z_]+): ")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


def from_decode_error(exc: msgspec.DecodeError, body: bytes) -> ApiError:
    """The 400 for a body msgspec refused: malformed JSON, bad UTF-8, or a schema mismatch."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        path = _PATH.search(text)
        unknown = _UNKNOWN_FIELD.search(text)
        missing = _MISSING_FIELD.search(text)
        named = unknown or missing
        param = path.group(1) if path else (named.group(1) if named else None)
        code = "unknown_parameter" if unknown else "invalid_type"
        return ApiError(400, f"invalid request body: {text}", param=param, code=code)
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as utf8:
        return ApiError(
            400, f"request body is not valid UTF-8: {utf8.reason}", code="invalid_encoding"
        )
    return ApiError(400, f"request body is not valid JSON: {text}", code="invalid_json")


def too_deep(what: str, param: str | None = None) -> ApiError:
    """The 400 for JSON nested deeper than the decoder's limit (a RecursionError there)."""
    return ApiError(
        400, f"{what} is nested too deeply (JSON depth limit)", param=param, code="invalid_json"
    )


def from_generation_error(exc: GenerationError) -> ApiError:
    """The engine refused a request: bad input is a 400, a full queue a 429 (retry after a
    second), an unknown session 404, a session already running a turn 409, an engine that
    stopped a 503, anything else a 500."""
    if exc.code == ERR_OVERLOADED:
        return ApiError(
            429,
            exc.message,
            type="rate_limit_error",
            code="overloaded",
            headers=[(b"retry-after", b"1")],
        )
    if exc.code == ERR_SESSION_NOT_FOUND:
        return ApiError(404, exc.message, type=NOT_FOUND, param="session_id", code=exc.code)
    if exc.code == ERR_SESSION_BUSY:
        return ApiError(409, exc.message, param="session_id", code=exc.code)
    if exc.code == ERR_SESSION_LIMIT:
        return ApiError(429, exc.message, type="rate_limit_error", code=exc.code)
    if exc.code == ERR_ENGINE_STOPPED:
        return ApiError(503, exc.message, type=UNAVAILABLE, code="engine_stopped")
    if exc.code in (ERR_INVALID_REQUEST, ERR_CONTEXT_LENGTH):
        named = _FIELD_PREFIX.match(exc.message)
        param = named.group(1) if named else None
        # too long for the model's context, or for the whole KV pool where that is smaller
        code = "context_length_exceeded" if exc.code == ERR_CONTEXT_LENGTH else None
        return ApiError(400, exc.message, param=param, code=code)
    return ApiError(500, f"engine error: {exc.code}: {exc.message}", type=SERVER_ERROR)
