"""Async ZeroMQ channels: a ROUTER server and a DEALER client with request/reply correlation.

Frames on the wire (identical over inproc, ipc and tcp):

    client -> server   [envelope, payload]          (ROUTER prepends the peer identity)
    server -> client   [envelope(kind=REPLY), payload]

``Envelope`` is a tiny array-encoded header: the kind (call, send or reply), a per-client
request id that correlates a reply with its call, and the sender's name. Payloads are opaque
bytes here (``transport.codec`` turns them into messages).

Concurrency model, all on ``zmq.asyncio`` sockets from one process-wide context:

* ``ServerChannel.recv`` is meant for one consumer task (an actor's mailbox loop).
* ``ClientChannel.call`` may be awaited by many tasks at once. There is no reader task: the
  first waiting caller becomes the *leader*, receives from the socket and hands every reply
  it reads to the caller waiting for it; when its own reply arrives it passes leadership to
  another waiter. A client therefore needs no task group and can be used from any task.
* Every wait on a socket runs in a cancel scope the channel tracks, so ``close()`` ends it
  with ``ChannelClosed`` (instead of pyzmq cancelling its future from under anyio) before
  the socket closes. Calls carry a deadline: nothing here waits forever.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

import anyio
import msgspec
import zmq
import zmq.asyncio

from transport.security import secure_client, secure_server

KIND_CALL: Final = 1  # expects exactly one REPLY with the same request_id
KIND_SEND: Final = 2  # fire-and-forget, never answered
KIND_REPLY: Final = 3

# Per-socket queue bound in messages. A DEALER blocks its senders beyond it (callers see their
# timeout); the ROUTER drops replies beyond it (the caller times out, the drop is counted).
DEFAULT_HWM: Final = 10_000


class Envelope(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The header frame of every channel message (the ``sender`` argument of ``Actor.handle``)."""

    kind: int
    request_id: int = 0
    sender: str = ""

    @property
    def is_call(self) -> bool:
        return self.kind == KIND_CALL


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)


def encode_envelope(envelope: Envelope) -> bytes:
    return _envelope_encoder.encode(envelope)


def decode_envelope(data: bytes) -> Envelope | None:
    """The envelope, or None when the frame is not a valid envelope."""
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    if envelope.kind not in (KIND_CALL, KIND_SEND, KIND_REPLY) or envelope.request_id < 0:
        return None
    return envelope


class ChannelClosed(Exception):
    """The channel was closed while (or before) the operation waited on it."""


def shared_context() -> zmq.asyncio.Context:
    """The process-wide zmq context. inproc endpoints only connect within one context."""
    return zmq.asyncio.Context.instance()


def _configure(socket: zmq.asyncio.Socket, hwm: int) -> None:
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)


class _SocketGuard:
    """Owns one socket and the cancel scopes of the operations currently waiting on it.

    Invariant: the socket is closed only by ``close()``, and only after every tracked scope
    has been cancelled, so a waiting task leaves through its own scope (and reports
    ``ChannelClosed``) instead of receiving a bare cancellation of a pyzmq future.
    """

    __slots__ = ("socket", "closed", "_scopes")

    def __init__(self, socket: zmq.asyncio.Socket) -> None:
        self.socket = socket
        self.closed = False
        self._scopes: set[anyio.CancelScope] = set()

    def track(self, scope: anyio.CancelScope) -> None:
        if self.closed:
            raise ChannelClosed("channel is closed")
        self._scopes.add(scope)

    def untrack(self, scope: anyio.CancelScope) -> None:
        self._scopes.discard(scope)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for scope in list(self._scopes):
            scope.cancel()
        self.socket.close(linger=0)


@dataclass(slots=True)
class Incoming:
    """One message received by a server: who sent it, its header and its payload bytes."""

    peer: bytes
    envelope: Envelope
    payload: bytes


class ServerChannel:
    """A bound ROUTER socket. One task receives; replies may be sent from any task."""

    def __init__(
        self,
        address: str,
        *,
        context: zmq.asyncio.Context | None = None,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int | None = None,
    ) -> None:
        """Bind a ROUTER at ``address``. ``max_message_bytes`` (ipc/tcp only) makes zmq drop
        the connection of a peer that sends a larger frame, before it is buffered whole."""
        socket = (context or shared_context()).socket(zmq.ROUTER)
        try:
            _configure(socket, hwm)
            # Unroutable replies (peer gone, queue full) raise instead of vanishing silently.
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if max_message_bytes is not None:
                socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            secure_server(socket, address)
            socket.bind(address)
            self.address: str = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            socket.close(linger=0)
            raise
        self._guard = _SocketGuard(socket)
        # Frames received by a recv whose task was cancelled at that very instant; served first
        # by the next recv so a restarted consumer loses nothing.
        self._salvaged: deque[list[bytes]] = deque()
        self.malformed_frames = 0  # frames dropped because they were not [peer, envelope, body]
        self.dropped_replies = 0  # replies that could not be routed to their caller

    @property
    def closed(self) -> bool:
        return self._guard.closed

    async def recv(self) -> Incoming:
        """The next well-formed message. Malformed multipart frames are counted and skipped.

        Raises ``ChannelClosed`` when the channel is (or gets) closed.
        """
        guard = self._guard
        while True:
            if guard.closed:
                raise ChannelClosed("channel is closed")
            if self._salvaged:
                frames = self._salvaged.popleft()
            else:
                received = guard.socket.recv_multipart()
                if not received.done():
                    with anyio.CancelScope() as scope:
                        guard.track(scope)
                        try:
                            await received
                        except BaseException:
                            if received.done() and not received.cancelled():
                                if received.exception() is None:
                                    self._salvaged.append(received.result())
                            raise
                        finally:
                            guard.untrack(scope)
                    if scope.cancel_called:
                        raise ChannelClosed("channel closed while receiving")
                frames = received.result()
            if len(frames) == 3:
                envelope = decode_envelope(frames[1])
                if envelope is not None and envelope.kind != KIND_REPLY:
                    return Incoming(frames[0], envelope, frames[2])
            self.malformed_frames += 1

    def reply(self, peer: bytes, request_id: int, payload: bytes) -> bool:
        """Send a reply without waiting. False (and counted) when it cannot be routed now."""
        if self._guard.closed:
            return False
        header = encode_envelope(Envelope(KIND_REPLY, request_id))
        sent = self._guard.socket.send_multipart((peer, header, payload), flags=zmq.NOBLOCK)
        # pyzmq resolves a NOBLOCK send immediately: the future is already done here.
        if sent.exception() is not None:
            self.dropped_replies += 1
            return False
        return True

    def close(self) -> None:
        """Close the socket (LINGER 0); a task blocked in ``recv`` gets ``ChannelClosed``."""
        self._guard.close()


@dataclass(slots=True)
class _PendingCall:
    reply: bytes | None = None
    # Set while this caller waits as a follower: fired when its reply arrives, when it must
    # take over as leader, or when the channel closes.
    wakeup: anyio.Event | None = None


class ClientChannel:
    """A DEALER socket connected to one server; concurrent ``call``s and ``send``s."""

    def __init__(
        self,
        address: str,
        *,
        sender: str = "",
        context: zmq.asyncio.Context | None = None,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        socket = (context or shared_context()).socket(zmq.DEALER)
        try:
            _configure(socket, hwm)
            secure_client(socket, address)
            socket.connect(address)
        except BaseException:
            socket.close(linger=0)
            raise
        self.address = address
        self.sender = sender
        self._guard = _SocketGuard(socket)
        self._request_ids = itertools.count(1)
        self._send_header = encode_envelope(Envelope(KIND_SEND, 0, sender))
        self._pending: dict[int, _PendingCall] = {}
        self._leader: _PendingCall | None = None
        self.late_replies = 0  # replies whose caller had already given up (timeout)
        self.malformed_frames = 0

    @property
    def closed(self) -> bool:
        return self._guard.closed

    async def call(self, payload: bytes, *, timeout: float) -> bytes:
        """Send ``payload`` as a call and return the reply payload.

        Raises ``TimeoutError`` after ``timeout`` seconds and ``ChannelClosed`` if the channel
        closes first. A reply arriving after the timeout is counted and dropped.
        """
        guard = self._guard
        if guard.closed:
            raise ChannelClosed("channel is closed")
        request_id = next(self._request_ids)
        pending = _PendingCall()
        self._pending[request_id] = pending
        header = encode_envelope(Envelope(KIND_CALL, request_id, self.sender))
        try:
            # One scope serves both the deadline and close(): whichever fires, it is absorbed
            # here and turned into the matching exception below.
            with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                guard.track(scope)
                try:
                    await self._send_frames((header, payload))
                    while pending.reply is None and not guard.closed:
                        if self._leader is None:
                            await self._lead(pending)
                        else:
                            await self._follow(pending)
                finally:
                    guard.untrack(scope)
        finally:
            del self._pending[request_id]
        if pending.reply is not None:
            return pending.reply
        if guard.closed:
            raise ChannelClosed("channel closed while waiting for a reply")
        raise TimeoutError(f"no reply from {self.address} within {timeout} s")

    async def send(self, payload: bytes, *, timeout: float) -> None:
        """Fire-and-forget. Waits only while the queue is full (then ``TimeoutError``)."""
        guard = self._guard
        if self._try_send((self._send_header, payload)):
            return
        with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
            guard.track(scope)
            try:
                await guard.socket.send_multipart((self._send_header, payload))
                return
            finally:
                guard.untrack(scope)
        if guard.closed:
            raise ChannelClosed("channel closed while sending")
        raise TimeoutError(f"send queue to {self.address} stayed full for {timeout} s")

    def close(self) -> None:
        """Close the socket (LINGER 0). Waiting callers get ``ChannelClosed``."""
        if self._guard.closed:
            return
        self._guard.close()
        for pending in self._pending.values():
            if pending.wakeup is not None:
                pending.wakeup.set()

    def _try_send(self, frames: tuple[bytes, bytes]) -> bool:
        """Send without waiting; False when the queue is full. Raises on other errors."""
        if self._guard.closed:
            raise ChannelClosed("channel is closed")
        # pyzmq tries a non-blocking send first and returns an already-finished future.
        sent = self._guard.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        error = sent.exception()
        if error is None:
            return True
        if isinstance(error, zmq.Again):
            return False
        raise error

    async def _send_frames(self, frames: tuple[bytes, bytes]) -> None:
        if not self._try_send(frames):
            # Queue full: wait for room, bounded by the caller's scope.
            await self._guard.socket.send_multipart(frames)

    async def _lead(self, pending: _PendingCall) -> None:
        """Read replies for everybody until ``pending`` has its own, then hand over."""
        self._leader = pending
        socket = self._guard.socket
        try:
            while pending.reply is None and not self._guard.closed:
                # pyzmq returns an already-finished future when a reply is queued, so a burst
                # of replies is dispatched without a trip through the event loop.
                received = socket.recv_multipart()
                if not received.done():
                    try:
                        await received
                    except BaseException:
                        # Cancelled in the instant after the reply arrived: deliver it anyway,
                        # it may belong to another caller.
                        if received.done() and not received.cancelled():
                            if received.exception() is None:
                                self._dispatch(received.result())
                        raise
                self._dispatch(received.result())
        finally:
            self._leader = None
            self._promote_a_follower()

    async def _follow(self, pending: _PendingCall) -> None:
        pending.wakeup = anyio.Event()
        try:
            await pending.wakeup.wait()
        finally:
            pending.wakeup = None

    def _promote_a_follower(self) -> None:
        for other in self._pending.values():
            if other.reply is None and other.wakeup is not None:
                other.wakeup.set()
                return

    def _dispatch(self, frames: list[Any]) -> None:
        envelope = decode_envelope(frames[0]) if len(frames) == 2 else None
        if envelope is None or envelope.kind != KIND_REPLY:
            self.malformed_frames += 1
            return
        pending = self._pending.get(envelope.request_id)
        if pending is None or pending.reply is not None:
            self.late_replies += 1
            return
        pending.reply = frames[1]
        if pending.wakeup is not None:
            pending.wakeup.set()
