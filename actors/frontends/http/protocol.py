"""uvicorn's h11 protocol with the limits a public server needs: a header deadline and a
connection cap.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) but not the time a client
may take to send its request head: a connection that never sends a byte, or sends one a
second (slow loris), stays open for ever. `guarded_h11_protocol` returns a subclass that

* arms a deadline when a connection opens and after every response: the request head must
  be complete within `header_timeout_s`, else the server answers 408 and closes;
* refuses a connection beyond `max_connections` at once with a 503 and a close.

The body's read time is bounded by the app (`GatewayApp`, `body_timeout_s`), which sees it.
Invariant: every close here is a written response followed by `transport.close()`; nothing
is left half-open.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from actors.runtime.logging import get_logger

_log = get_logger("gateway")


def _plain_response(status: int, reason: str, message: str) -> bytes:
    body = f'{{"error":{{"message":"{message}","type":"{reason}","code":{status}}}}}'.encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


REQUEST_TIMEOUT = _plain_response(
    408, "Request Timeout", "the request head was not received in time"
)
TOO_MANY_CONNECTIONS = _plain_response(
    503, "Service Unavailable", "too many open connections; retry later"
)


def guarded_h11_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An `H11Protocol` class enforcing these limits (pass it as uvicorn's `http`)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _log.warning("connection refused: too many open", limit=max_connections)
                transport.write(TOO_MANY_CONNECTIONS)
                transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_header_timer()  # the head is in: the app bounds the body

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # the next request's head has the same deadline

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response is still being written (pipelining): not idle
            self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()

    return GuardedH11Protocol
