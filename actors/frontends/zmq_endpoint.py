"""The ZeroMQ client endpoint: external clients speak `transport.messages.client` to it.

`ZmqEndpointActor(address)` binds a ROUTER socket for clients (DEALER sockets, see
`transport.client.KvactorClient`). It is a `FrontendActor`: each accepted `ClientSubmit`
runs as one task reading `EngineClient.generate` and turning its chunks into `ClientChunk`
frames for the client identity that submitted it; ending that task (the client's
`ClientAbort`, the client gone, a full send queue) closes the stream, which aborts the
request in the engine (the shared base's rule).

Invariants:
* A live request is in `self.clients[identity]` (client request id -> route) exactly while
  its task runs; the task removes it on every exit path.
* Nothing a client sends can crash the actor: undecodable frames, unknown ids, duplicate
  ids and refused requests are answered with `ClientError` frames.
* The socket is ROUTER_MANDATORY, so a frame to a client that is gone fails instead of
  vanishing: every live request of that client is ended. A client whose send queue is full
  (it stopped reading) has the request being written to ended rather than silently losing
  frames.
* A request belongs to the connection it came in on (the frame's source fd): when that
  connection closes, or stops answering ZeroMQ heartbeats, the socket monitor reports it
  and the request ends at once, streaming or not. A later peer that presents the same
  routing id never receives it.
* With API keys, every frame must carry one of them; with a CURVE secret, the socket is a
  CURVE server (clients need its public key).
* A streaming session belongs to the API key that opened it (`engine_session_id`): under
  another key it does not exist (session_not_found), as on HTTP; with no keys, anyone's.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import os
from dataclasses import dataclass, field

import anyio
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from actors.frontends.base import FrontendActor, GenerationError
from actors.tokenizer.validation import ERR_CONTEXT_LENGTH as ENGINE_CONTEXT_LENGTH
from actors.tokenizer.validation import ERR_INVALID_REQUEST as ENGINE_INVALID_REQUEST
from actors.tokenizer.validation import ERR_OVERLOADED as ENGINE_OVERLOADED
from transport.channel import ChannelClosed, shared_context
from transport.codec import Codec, DecodeFailure
from transport.messages.client import (
    ERR_DUPLICATE_ID,
    ERR_ENGINE,
    ERR_INVALID_REQUEST,
    ERR_MALFORMED,
    ERR_OVERLOADED,
    ERR_SESSION_BUSY,
    ERR_SESSION_LIMIT,
    ERR_SESSION_NOT_FOUND,
    ERR_SHUTTING_DOWN,
    ERR_SLOW_CLIENT,
    ERR_UNAUTHORIZED,
    FINISH_ABORT,
    MAX_CLIENT_FRAME_BYTES,
    MAX_REQUEST_ID_CHARS,
    ClientAbort,
    ClientChunk,
    ClientError,
    ClientRequestFrame,
    ClientSession,
    ClientSessionInfo,
    ClientSubmit,
    ClientUsage,
)
from transport.messages.engine import OutputChunk, TokenLogprob
from transport.security import read_curve_secret

# Hard cap enforced by libzmq: a peer sending a bigger message is disconnected. Frames between
# MAX_CLIENT_FRAME_BYTES and this get a ClientError instead.
_ZMQ_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_HEARTBEAT_IVL_MS = 1000  # ZeroMQ heartbeats: a peer silent for the timeout is gone
_HEARTBEAT_TIMEOUT_MS = 5000
_CLIENT_HWM = 100_000  # frames queued per client before it counts as not reading


@dataclass(eq=False)
class _Route:
    """One live client request."""

    identity: bytes
    request_id: str
    engine_rid: str
    stream: bool
    fd: int = -1  # the client connection it came in on
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended: bool = False  # the client got its final frame (or can get none)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Only for stream=False: the whole output, sent at the end.
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def usage(self) -> ClientUsage:
        return ClientUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )


class ZmqEndpointActor(FrontendActor):
    def __init__(
        self,
        address: str,
        tokenizer: str = "tokenizer",
        api_key: str | list[str] | None = None,
        curve_secret_file: str | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self.address = address
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self._api_keys = [k.encode() for k in keys if k]  # any of them; none: no auth
        # CURVE on the client socket: clients need the server's public key (encryption and
        # server identity); who may submit is still decided by the API key.
        self._curve_secret = read_curve_secret(curve_secret_file) if curve_secret_file else None
        self._context: zmq.asyncio.Context | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.codec: Codec = Codec(ClientRequestFrame, max_message_bytes=MAX_CLIENT_FRAME_BYTES)
        self.clients: dict[bytes, dict[str, _Route]] = {}
        self._ids = itertools.count(1)
        self._prefix = f"zmq-{os.getpid()}-{id(self):x}"
        self._socket: zmq.asyncio.Socket | None = None
        self.counters = {
            "unauthorized": 0,
            "departed": 0,
            "submitted": 0,
            "refused": 0,
            "aborted": 0,
            "malformed": 0,
            "clients_gone": 0,
            "slow_clients": 0,
        }

    async def on_start(self) -> None:
        await super().on_start()
        if self._curve_secret is not None:
            # Its own context: the internal sockets' ZAP handler must not judge clients.
            self._context = zmq.asyncio.Context()
        sock = (self._context or shared_context()).socket(zmq.ROUTER)
        try:
            if self._curve_secret is not None:
                sock.curve_secretkey = self._curve_secret
                sock.curve_publickey = zmq.curve_public(self._curve_secret)
                sock.curve_server = True
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, _CLIENT_HWM)
            sock.setsockopt(zmq.RCVHWM, _CLIENT_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
            sock.bind(self.address)  # raises (address in use, bad address): the actor crashes
        except BaseException:
            sock.close(linger=0)
            raise
        self._socket = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.spawn(self._serve_clients)
        self.spawn(self._watch_disconnects)
        self.log.info("zmq endpoint listening", address=self.address)

    async def on_stop(self) -> None:
        # The request tasks were cancelled with the actor (each aborted its request); a
        # client still waiting is told why its request ends before the socket closes.
        for routes in list(self.clients.values()):
            for route in list(routes.values()):
                self._refuse(route, ERR_ENGINE, "the engine stopped before this request finished")
        self.clients.clear()
        await super().on_stop()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close(linger=500)  # those last frames get half a second to leave
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def stats(self) -> dict[str, int | float]:
        live = sum(len(routes) for routes in self.clients.values())
        return {
            **super().stats(),
            "live_requests": live,
            "clients": len(self.clients),
            **self.counters,
        }

    # ---- client frames -----------------------------------------------------------------------

    async def _serve_clients(self) -> None:
        assert self._socket is not None
        while True:
            parts = await self._socket.recv_multipart(copy=False)
            # The connection (its file descriptor) the message came in on: a request is
            # bound to it, not only to the routing id a later peer could take over.
            fd = parts[-1].get(zmq.SRCFD)
            self._on_frames([part.bytes for part in parts], fd)

    async def _watch_disconnects(self) -> None:
        """The socket's monitor: a connection that closes (or misses its heartbeats) ends
        every request that came in on it, streaming or not."""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._on_connection_closed(int(event["value"]))

    def _on_frames(self, frames: list[bytes], fd: int = -1) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self.counters["malformed"] += 1
            self._error(
                identity,
                ERR_MALFORMED,
                f"expected exactly one frame per message, got {len(frames) - 1}",
            )
            return
        message = self.codec.decode(frames[1])
        if isinstance(message, DecodeFailure):
            self.counters["malformed"] += 1
            self._error(identity, ERR_MALFORMED, f"undecodable frame: {message}"[:2000])
            return
        key = ""  # the configured key the frame carries: it owns the sessions it opens
        if self._api_keys:
            given = (message.api_key or "").encode()
            matched = [k for k in self._api_keys if hmac.compare_digest(given, k)]
            if not matched:
                self.counters["unauthorized"] += 1
                self._error(
                    identity, ERR_UNAUTHORIZED, "missing or wrong api_key", message.request_id
                )
                return
            key = matched[0].decode()
        routes = self.clients.get(identity)
        if routes and any(route.fd != fd for route in routes.values()):
            # A new connection took over this routing id: the old one is gone (its close
            # may not have been reported yet), and so are its requests.
            self._end_routes([r for r in routes.values() if r.fd != fd])
        if isinstance(message, ClientSubmit):
            self._on_submit(identity, message, fd, key)
        elif isinstance(message, ClientAbort):
            route = self.clients.get(identity, {}).get(message.request_id)
            if route is not None:
                self._abort(route)
        elif isinstance(message, ClientSession):
            self.spawn(self._session_op, identity, message, key)

    def _on_connection_closed(self, fd: int) -> None:
        gone = [r for routes in self.clients.values() for r in routes.values() if r.fd == fd]
        if gone:
            self.counters["departed"] += 1
            self._end_routes(gone)

    def _end_routes(self, routes: list[_Route]) -> None:
        """End requests whose client has gone: nothing more is sent to their routing id."""
        for route in routes:
            route.ended = True
            self.counters["aborted"] += 1
            route.scope.cancel()  # the request's task aborts it in the engine
            self._forget(route)

    def _on_submit(self, identity: bytes, msg: ClientSubmit, fd: int = -1, key: str = "") -> None:
        rid = msg.request_id
        if not self.accepting:
            self._error(identity, ERR_SHUTTING_DOWN, "the engine is shutting down", rid)
            return
        if not rid or len(rid) > MAX_REQUEST_ID_CHARS:
            self._error(
                identity,
                ERR_MALFORMED,
                f"request_id must have 1..{MAX_REQUEST_ID_CHARS} characters",
                rid,
            )
            return
        routes = self.clients.setdefault(identity, {})
        if rid in routes:
            self._error(identity, ERR_DUPLICATE_ID, f"request {rid!r} is already running", rid)
            return
        route = _Route(identity, rid, f"{self._prefix}-{next(self._ids)}", msg.stream, fd)
        routes[rid] = route
        self.counters["submitted"] += 1
        self.spawn(self._run, route, msg, key)

    async def _run(self, route: _Route, msg: ClientSubmit, key: str = "") -> None:
        """One request, from submit to its final frame; leaving early aborts it."""
        assert self.client is not None
        try:
            with route.scope:
                stream = self.client.generate(
                    msg.params,
                    prompt=msg.prompt,
                    prompt_ids=msg.prompt_ids,
                    messages=msg.messages,
                    client_rid=route.engine_rid,
                    session_id=msg.session_id,
                    session_key=key,
                )
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        if not self._forward(route, chunk):
                            return
        except GenerationError as exc:
            self._refuse(route, _client_code(exc.code), exc.message)
        except (TimeoutError, ChannelClosed) as exc:
            self._refuse(route, ERR_ENGINE, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a client's request must never crash the endpoint
            self.log.error("request failed", request_id=route.request_id, exc_info=exc)
            self._refuse(route, ERR_ENGINE, f"{type(exc).__name__}: {exc}")
        finally:
            self._forget(route)

    async def _session_op(self, identity: bytes, msg: ClientSession, key: str = "") -> None:
        """Open, inspect or close a session (owned by `key`): one ClientSessionInfo or
        ClientError."""
        assert self.client is not None
        try:
            if msg.op == "open":
                info = await self.client.open_session(
                    msg.ttl_s, msg.max_tokens, key, msg.priority, msg.retain_s
                )
            elif msg.op == "get":
                info = await self.client.get_session(msg.session_id, key)
            elif msg.op == "offload":
                info = await self.client.offload_session(msg.session_id, key)
            elif msg.op == "prefetch":
                info = await self.client.prefetch_session(msg.session_id, key)
            else:
                info = await self.client.close_session(msg.session_id, key)
        except GenerationError as exc:
            self._error(identity, _client_code(exc.code), exc.message, msg.request_id)
            return
        except (TimeoutError, ChannelClosed) as exc:
            self._error(identity, ERR_ENGINE, f"{type(exc).__name__}: {exc}", msg.request_id)
            return
        self._send(
            identity,
            ClientSessionInfo(
                request_id=msg.request_id,
                session_id=info.session_id,
                ttl_s=info.ttl_s,
                max_tokens=info.max_tokens,
                turns=info.turns,
                tokens=info.tokens,
                held_tokens=info.held_tokens,
                idle_s=info.idle_s,
                busy=info.busy,
                closed=info.closed,
                pool_tokens=info.pool_tokens,
                priority=info.priority,
                retain_s=info.retain_s,
            ),
        )

    def _refuse(self, route: _Route, code: str, message: str) -> None:
        self.counters["refused"] += 1
        if not route.ended:
            route.ended = True
            self._error(route.identity, code, message, route.request_id)

    def _abort(self, route: _Route) -> None:
        """The client's ClientAbort: its final frame now; the task's exit aborts the engine's."""
        self._end(route)
        self._send(
            route.identity,
            ClientChunk(
                request_id=route.request_id, finish_reason=FINISH_ABORT, usage=route.usage()
            ),
        )

    def _end(self, route: _Route) -> None:
        """Stop a live request's task (it may be the calling task)."""
        if not route.ended:
            route.ended = True
            self.counters["aborted"] += 1
        route.scope.cancel()

    def _forget(self, route: _Route) -> None:
        routes = self.clients.get(route.identity)
        if routes is not None and routes.get(route.request_id) is route:
            del routes[route.request_id]
            if not routes:
                del self.clients[route.identity]

    # ---- engine output -----------------------------------------------------------------------

    def _forward(self, route: _Route, chunk: OutputChunk) -> bool:
        """Send what `chunk` adds to the route's client; False when the request must end."""
        route.prompt_tokens = chunk.prompt_tokens
        route.completion_tokens = chunk.completion_tokens
        route.cached_tokens = chunk.cached_tokens
        final = chunk.finish_reason is not None
        if route.stream:
            frame = ClientChunk(
                request_id=route.request_id,
                text=chunk.text,
                token_ids=list(chunk.token_ids),
                finish_reason=chunk.finish_reason,
                usage=route.usage() if final else None,
                logprobs=list(chunk.logprobs),
            )
        else:
            if chunk.text:
                route.texts.append(chunk.text)
            route.token_ids.extend(chunk.token_ids)
            route.logprobs.extend(chunk.logprobs)
            if not final:
                return True
            frame = ClientChunk(
                request_id=route.request_id,
                text="".join(route.texts),
                token_ids=route.token_ids,
                finish_reason=chunk.finish_reason,
                usage=route.usage(),
                logprobs=route.logprobs,
            )
        outcome = self._send(route.identity, frame)
        if outcome == "gone":
            # Every request of a vanished client ends, this one included.
            for other in list(self.clients.get(route.identity, {}).values()):
                self._end(other)
            return False
        if outcome == "full":
            self.counters["slow_clients"] += 1
            self._error(
                route.identity,
                ERR_SLOW_CLIENT,
                "the client stopped reading; request aborted",
                route.request_id,
            )
            self._end(route)
            return False
        if final:
            route.ended = True
        return True

    # ---- sending -----------------------------------------------------------------------------

    def _send(self, identity: bytes, frame: ClientChunk | ClientError | ClientSessionInfo) -> str:
        """Queue one frame without waiting: "ok", "gone" (no such peer) or "full"."""
        sock = self._socket
        if sock is None:
            return "gone"
        sent = sock.send_multipart([identity, self.codec.encode(frame)], flags=zmq.NOBLOCK)
        # pyzmq resolves a NOBLOCK send at once: the future is already done here.
        error = sent.exception()
        if error is None:
            return "ok"
        if isinstance(error, zmq.Again):
            return "full"
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self.counters["clients_gone"] += 1
            return "gone"
        raise error

    def _error(
        self, identity: bytes, code: str, message: str, request_id: str | None = None
    ) -> None:
        self._send(identity, ClientError(code=code, message=message, request_id=request_id))


_CLIENT_CODES = {
    ENGINE_INVALID_REQUEST: ERR_INVALID_REQUEST,
    ENGINE_CONTEXT_LENGTH: ERR_INVALID_REQUEST,  # the protocol's code for any bad input
    ENGINE_OVERLOADED: ERR_OVERLOADED,
    ERR_SESSION_NOT_FOUND: ERR_SESSION_NOT_FOUND,
    ERR_SESSION_BUSY: ERR_SESSION_BUSY,
    ERR_SESSION_LIMIT: ERR_SESSION_LIMIT,
}


def _client_code(engine_code: str) -> str:
    """The protocol's ClientError code for an engine refusal."""
    return _CLIENT_CODES.get(engine_code, ERR_ENGINE)
