"""Server-sent events framing for streamed completions.

A stream is a sequence of `data: <json>\\n\\n` events closed by `data: [DONE]\\n\\n`, as
OpenAI sends them. Errors that happen after the response has started (headers are gone)
are sent as one `data: {"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

from typing import Any

import msgspec

SSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DONE_EVENT = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def sse_event(payload: Any) -> bytes:
    """One `data:` event holding `payload` (a msgspec Struct or plain JSON value)."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def named_sse_event(event: str, payload: Any) -> bytes:
    """One `event: <name>` + `data:` event, as the Responses and Messages APIs stream."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"
