"""ASGI plumbing of the gateway: the types, plain responses, headers, and request bodies
read under a size cap and a deadline, then decoded strictly.

A body over the cap is refused with 413 as soon as it is seen (from Content-Length, or
while reading); up to `DRAIN_LIMIT_BYTES` the rest is read and dropped so the client can
read its 413 (unless it waits for `100 Continue`), beyond that the connection is closed
after it. A body not complete within the deadline is a 408 (then a close). Decoding is
strict (`msgspec` against the endpoint's schema; a bad body is a 400); unknown top-level
fields are ignored, as vLLM does, and logged once each.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from actors.frontends.http.errors import NOT_FOUND, ApiError, from_decode_error, too_deep
from actors.runtime.logging import get_logger

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
# An oversized body is read and dropped up to this size so the client can read its 413;
# beyond it the connection is closed after the 413 is sent.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024

_log = get_logger("gateway")


class ClientGone(Exception):
    """The client disconnected before its request was read; nothing to answer."""


async def send_response(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128:
        text = given.decode("latin-1")
        if all(c.isalnum() or c in "-_.:" for c in text):
            return text
    return uuid.uuid4().hex


def check_json_content_type(scope: Scope) -> None:
    """A body declared as anything but JSON is refused with 415, as vLLM does (`curl -d`
    sends form encoding); a body with no Content-Type is read as JSON."""
    declared = header(scope, b"content-type")
    if declared is None:
        return
    media = declared.split(b";", 1)[0].strip().lower()
    if media != b"application/json" and not media.endswith(b"+json"):
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {media.decode('latin-1')[:100]!r}",
            code="unsupported_media_type",
        )


class RequestBodies:
    """Reads a request's body under `max_body_bytes` and `body_timeout_s`, and decodes it."""

    def __init__(self, max_body_bytes: int, body_timeout_s: float) -> None:
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._warned_fields: set[str] = set()

    async def read(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body, refused with 413 as soon as it exceeds the cap, and with 408 (then
        a close) when it is not complete within `body_timeout_s` (a slow or short body)."""
        try:
            with anyio.fail_after(self.body_timeout_s):
                body = await self._read_unbounded(scope, receive)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body was not received within {self.body_timeout_s:g} s",
                code="request_timeout",
                headers=[(b"connection", b"close")],
            ) from None
        check_json_content_type(scope)  # after the body: the connection stays usable
        return body

    async def _read_unbounded(self, scope: Scope, receive: Receive) -> bytes:
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "invalid Content-Length header", code="invalid_header")
            if int(declared) > self.max_body_bytes:
                # A client waiting for `100 Continue` has sent nothing: refuse, then close.
                waits = header(scope, b"expect") == b"100-continue"
                drained = (
                    not waits and int(declared) <= DRAIN_LIMIT_BYTES and await _drain(receive, 0)
                )
                raise self._too_large(drained)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            part = message.get("body", b"")
            size += len(part)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                drained = not more or await _drain(receive, size)
                raise self._too_large(drained)
            parts.append(part)
            if not more:
                return b"".join(parts)

    def _too_large(self, drained: bool) -> ApiError:
        return ApiError(
            413,
            f"request body exceeds {self.max_body_bytes} bytes",
            code="request_too_large",
            headers=[] if drained else [(b"connection", b"close")],
        )

    def decode(self, body: bytes, schema: type) -> Any:
        if not body:
            raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
        try:
            req = msgspec.json.decode(body, type=schema)
            self._warn_unknown_fields(body, schema)
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc, body) from None
        except RecursionError:  # msgspec's own nesting limit (about 1,000 levels)
            raise too_deep("request body") from None
        return req

    def _warn_unknown_fields(self, body: bytes, schema: type) -> None:
        """Unknown top-level fields are ignored, as vLLM does; each name is logged once."""
        raw = msgspec.json.decode(body)
        if not isinstance(raw, dict):
            return
        known = {f.name for f in msgspec.structs.fields(schema)}
        unknown = sorted(k for k in raw if k not in known)
        fresh = [k for k in unknown if k not in self._warned_fields]
        if fresh:
            self._warned_fields.update(fresh[:64])
            _log.warning(
                "ignoring unknown request fields",
                fields=[k[:64] for k in fresh][:16],
                schema=schema.__name__,
            )


async def _drain(receive: Receive, already: int) -> bool:
    """Read and drop the rest of a body; True when it ended within DRAIN_LIMIT_BYTES."""
    size = already
    while size <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


def path_id(scope: Scope, prefix: str, suffix: str = "") -> str:
    """The object id that ends a path under `prefix` (`/v1/sessions/{id}`), or that comes
    before `suffix` (`/v1/sessions/{id}/offload`); 404 when it is empty or has more
    segments."""
    path = scope["path"]
    rest = path[len(prefix) :]
    if suffix:
        rest = rest.removesuffix(suffix) if rest.endswith(suffix) else ""
    if not rest or "/" in rest:
        shown = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
        raise ApiError(404, f"no route {shown}", type=NOT_FOUND, code="not_found")
    return rest
