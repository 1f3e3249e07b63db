"""``ActorCell``: one actor instance on its mailbox, and the failure rules of the runtime.

One ``ActorCell`` runs one actor instance: it binds the actor's ROUTER endpoint, runs
``on_start``, then serves the mailbox strictly one message at a time in arrival order, then
runs ``on_stop``. Only the handling actor's mailbox is serialised: while actor A awaits a call
to actor B inside ``handle``, B keeps serving, so nested calls do not deadlock (a call cycle
A -> B -> A does, until its timeout).

Failure rules, enforced here:

* An exception in ``handle`` for a *call* becomes an ``ErrorReply`` to the caller (raised
  there as ``RemoteError``); it is logged and counted and the actor keeps serving.
* An exception in ``handle`` for a *send* (fire-and-forget) is logged and counted; unless it
  is a ``HandledError`` it crashes the actor, and the supervisor applies the actor's policy.
* An exception in a background task (``Actor.spawn`` / ``Actor.every``) crashes the actor.
* A payload that fails to decode against the inbox is answered with ``ErrorReply``
  (``bad_message``) when it was a call, counted, and never crashes the loop.
* ``Ping`` is answered by the runtime at once, even while a long message is being handled
  (``Pong.busy_s`` says for how long: health tells busy from stuck). ``StatsRequest`` is
  answered by the runtime in mailbox order; ``Shutdown`` is obeyed in mailbox order, and
  only from the actor system (``CONTROL_SENDERS``); from anyone else it is refused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.lowlevel
import msgspec
import zmq
from anyio.abc import TaskGroup, TaskStatus

from actors.runtime.actor import Actor, DeferredReply, inbox_codec
from actors.runtime.errors import HandledError, describe_exception, format_traceback, root_exception
from actors.runtime.logging import debug_enabled, get_logger
from actors.runtime.refs import DEFAULT_CALL_TIMEOUT_S, RefBook
from transport.channel import Envelope, ServerChannel
from transport.codec import DecodeFailure
from transport.messages.base import Message
from transport.messages.control import (
    ERR_BAD_MESSAGE,
    ERR_BAD_REPLY,
    ERR_HANDLER,
    Ack,
    ErrorReply,
    Ping,
    Pong,
    Shutdown,
    StatsReply,
    StatsRequest,
)

# Bounds on lifecycle hooks so a stuck actor can never hang start-up or shutdown.
DEFAULT_START_TIMEOUT_S: Final = 30.0
DEFAULT_STOP_TIMEOUT_S: Final = 5.0
# A mailbox loop yields to the event loop after this many messages that needed no wait.
_MESSAGES_PER_YIELD: Final = 32
_BIND_RETRY_S: Final = 2.0
_MAILBOX_QUEUE: Final = 10_000  # messages received ahead of the one being handled
# Senders whose Shutdown an actor obeys: the actor system and the hosts of its processes.
CONTROL_SENDERS: Final = frozenset({"system"})

_ACK_PAYLOAD: Final = msgspec.msgpack.encode(Ack())
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class CrashReport:
    """Why an actor stopped serving: the error text and its formatted traceback."""

    error: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> CrashReport:
        root = root_exception(exc)
        if isinstance(root, _ActorFailed) and root.__cause__ is not None:
            cause = root.__cause__
            return cls(
                error=f"{root}: {describe_exception(cause)}", traceback=format_traceback(cause)
            )
        return cls(error=describe_exception(root), traceback=format_traceback(root))


class _ActorFailed(Exception):
    """Raised inside the mailbox loop to crash the actor (wraps the handler's exception)."""


@dataclass(slots=True)
class MailboxCounters:
    handled: int = 0
    calls: int = 0
    sends: int = 0
    handler_errors: int = 0
    decode_failures: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return {
            "handled": self.handled,
            "calls": self.calls,
            "sends": self.sends,
            "handler_errors": self.handler_errors,
            "decode_failures": self.decode_failures,
        }


async def bind_mailbox(address: str) -> ServerChannel:
    """Bind an actor's ROUTER at ``address``, retrying briefly while the address is in use
    (a just-closed tcp port can linger in the zmq IO thread)."""
    deadline = time.monotonic() + _BIND_RETRY_S
    while True:
        try:
            return ServerChannel(address)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        await anyio.sleep(0.05)


class ActorCell:
    """Runs one actor instance on a bound mailbox, from ``on_start`` to ``on_stop``.

    ``run`` never raises actor errors: it returns ``None`` after a requested stop and a
    ``CrashReport`` after a crash. The mailbox (``server``) belongs to the caller and outlives
    the cell, so a restarted instance serves the messages that queued during the restart.
    """

    def __init__(
        self,
        actor: Actor,
        server: ServerChannel,
        directory: Mapping[str, str],
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        backlog: Sequence[Any] = (),
    ) -> None:
        if not actor.name:
            raise ValueError(f"actor {type(actor).__name__} has no name")
        self.actor = actor
        self.name = actor.name
        self.address = server.address
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.refs = RefBook(directory, sender=actor.name, call_timeout_s=call_timeout_s)
        self.log = get_logger("actor", actor=actor.name)
        self.counters = MailboxCounters()
        self._codec = inbox_codec(type(actor))
        self._server = server
        self._run_scope: anyio.CancelScope | None = None
        self._task_group: TaskGroup | None = None
        self._stop_requested = False
        self._started_at = time.monotonic()
        self._pid = os.getpid()
        self._busy_since: float | None = None  # when the message being handled began
        self._queued = 0
        self._in_hand: Any = None  # received, waiting for room in a full queue
        # Received, not yet handled: given by the host to a restarted instance, and left
        # here after a crash for the next one.
        self.backlog: list[Any] = list(backlog)
        actor._cell = self

    def stop(self) -> None:
        """Ask the cell to stop now (from any task): cancels the loop and background tasks."""
        self._stop_requested = True
        if self._run_scope is not None:
            self._run_scope.cancel()

    def spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._task_group is None:
            raise RuntimeError(f"actor {self.name!r} is not running; cannot spawn tasks")
        self._task_group.start_soon(function, *args)

    async def run(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> CrashReport | None:
        """Run ``on_start``, serve until stopped or crashed, then run ``on_stop`` (always).
        ``task_status.started()`` fires once ``on_start`` has returned."""
        crash: CrashReport | None = None
        started = False
        try:
            with anyio.CancelScope() as run_scope:
                self._run_scope = run_scope
                if self._stop_requested:
                    run_scope.cancel()
                try:
                    async with anyio.create_task_group() as task_group:
                        self._task_group = task_group
                        with anyio.fail_after(self.start_timeout_s):
                            await self.actor.on_start()
                        started = True
                        task_status.started()
                        await self._serve()
                        # Shutdown handled: end the background tasks too.
                        task_group.cancel_scope.cancel()
                except Exception as exc:
                    crash = CrashReport.from_exception(exc)
                finally:
                    self._task_group = None
        finally:
            # Runs on stop, on crash and when an enclosing scope cancels this cell.
            self._run_scope = None
            await self._finish()
        if not started and crash is None and not self._stop_requested:
            crash = CrashReport(error="actor stopped before it started", traceback="")
        return crash

    async def _finish(self) -> None:
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.stop_timeout_s) as stop_scope:
                try:
                    await self.actor.on_stop()
                except Exception as exc:
                    self.log.error("on_stop failed", error=describe_exception(exc), exc_info=exc)
            if stop_scope.cancelled_caught:
                self.log.error("on_stop timed out", timeout_s=self.stop_timeout_s)
        self.refs.close()

    async def _serve(self) -> None:
        """The mailbox: returns after a Shutdown, raises to crash the actor.

        A receiver answers Ping at once (with how long the current message has been running,
        so health can tell "busy" from "stuck") and queues every other message for one
        worker, which hands them to `handle` strictly one at a time in arrival order.
        StatsRequest and Shutdown take their place in that order.
        """
        send_queue, receive_queue = anyio.create_memory_object_stream[Any](_MAILBOX_QUEUE)
        for item in self.backlog:  # received by an earlier instance, never handled
            send_queue.send_nowait(item)
            self._queued += 1
        self.backlog = []
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._receive, send_queue)
                await self._work(receive_queue)
                group.cancel_scope.cancel()
        finally:
            # Whatever was received but not handled goes to the next instance (a restart).
            while True:
                try:
                    self.backlog.append(receive_queue.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            if self._in_hand is not None:
                self.backlog.append(self._in_hand)
                self._in_hand = None
            receive_queue.close()

    async def _receive(self, queue: Any) -> None:
        server = self._server
        decode = self._codec.decode
        async with queue:
            while True:
                incoming = await server.recv()
                envelope = incoming.envelope
                message = decode(incoming.payload)
                if isinstance(message, DecodeFailure):
                    self._reject(incoming.peer, envelope, message)
                elif isinstance(message, Ping):
                    self._control(incoming.peer, envelope, message)
                elif isinstance(message, Shutdown) and envelope.sender not in CONTROL_SENDERS:
                    self._refuse_control(incoming.peer, envelope)
                else:
                    self._queued += 1
                    try:  # never lose a received message to a cancellation (a crash)
                        queue.send_nowait((incoming, message))
                    except anyio.WouldBlock:
                        self._in_hand = (incoming, message)
                        await queue.send(self._in_hand)
                        self._in_hand = None

    async def _work(self, queue: Any) -> None:
        server = self._server
        handle = self.actor.handle
        counters = self.counters
        debug = debug_enabled()
        since_yield = 0
        # the queue is closed by _serve, which hands what is left to a restart
        async for incoming, message in queue:
            self._queued -= 1
            envelope = incoming.envelope
            if isinstance(message, (StatsRequest, Shutdown)):
                if self._control(incoming.peer, envelope, message):
                    return
                continue
            counters.handled += 1
            if debug:
                self.log.debug("handle", message=type(message).__name__, sender=envelope.sender)
            self._busy_since = time.monotonic()
            try:
                if envelope.is_call:
                    counters.calls += 1
                    try:
                        result = await handle(message, envelope)
                    except Exception as exc:
                        counters.handler_errors += 1
                        self._log_handler_error(exc, message, envelope)
                        reply = ErrorReply(
                            code=ERR_HANDLER,
                            message=describe_exception(exc),
                            detail=format_traceback(exc),
                        )
                        server.reply(incoming.peer, envelope.request_id, _encoder.encode(reply))
                        continue
                    if isinstance(result, DeferredReply):
                        self.spawn(self._reply_deferred, incoming.peer, envelope, message, result)
                        continue
                    self._reply_result(incoming.peer, envelope, message, result)
                else:
                    counters.sends += 1
                    try:
                        result = await handle(message, envelope)
                        if isinstance(result, DeferredReply):  # nobody to answer: just run it
                            peer = incoming.peer
                            self.spawn(self._reply_deferred, peer, envelope, message, result)
                    except HandledError as exc:
                        counters.handler_errors += 1
                        self._log_handler_error(exc, message, envelope)
                    except Exception as exc:
                        counters.handler_errors += 1
                        raise _ActorFailed(
                            f"{type(message).__name__} from {envelope.sender!r} failed"
                        ) from exc
            finally:
                self._busy_since = None
            since_yield += 1
            if since_yield >= _MESSAGES_PER_YIELD:
                since_yield = 0
                await anyio.lowlevel.checkpoint()
        raise _ActorFailed("the mailbox closed")

    async def _reply_deferred(
        self, peer: bytes, envelope: Envelope, message: Message, deferred: DeferredReply
    ) -> None:
        """Run the work of a handler that returned `reply_later(...)` and answer the call with
        its result; an exception is an ErrorReply to the caller (logged, counted) and never
        crashes the actor, a send's included."""
        try:
            result = await deferred.work()
        except Exception as exc:
            self.counters.handler_errors += 1
            self._log_handler_error(exc, message, envelope)
            reply = ErrorReply(
                code=ERR_HANDLER, message=describe_exception(exc), detail=format_traceback(exc)
            )
            if envelope.is_call:
                self._server.reply(peer, envelope.request_id, _encoder.encode(reply))
            return
        if envelope.is_call:
            self._reply_result(peer, envelope, message, result)

    def _refuse_control(self, peer: bytes, envelope: Envelope) -> None:
        self.counters.decode_failures += 1
        self.log.warning("control message refused", sender=envelope.sender)
        if envelope.is_call:
            reply = ErrorReply(
                code=ERR_BAD_MESSAGE, message="Shutdown is accepted from the supervisor only"
            )
            self._server.reply(peer, envelope.request_id, _encoder.encode(reply))

    def _reply_result(
        self, peer: bytes, envelope: Envelope, message: Message, result: object
    ) -> None:
        server = self._server
        if result is None:
            payload = _ACK_PAYLOAD
        elif isinstance(result, Message):
            payload = _encoder.encode(result)
        else:
            self.counters.handler_errors += 1
            text = f"handler for {type(message).__name__} returned {type(result).__name__}"
            self.log.error("handler returned a non-message", detail=text)
            payload = _encoder.encode(ErrorReply(code=ERR_BAD_REPLY, message=text))
        server.reply(peer, envelope.request_id, payload)

    def _reject(self, peer: bytes, envelope: Envelope, failure: DecodeFailure) -> None:
        self.counters.decode_failures += 1
        self.log.warning(
            "undecodable message",
            kind=failure.kind,
            detail=failure.detail[:200],
            sender=envelope.sender,
            call=envelope.is_call,
        )
        if envelope.is_call:
            reply = ErrorReply(code=ERR_BAD_MESSAGE, message=str(failure)[:1000])
            self._server.reply(peer, envelope.request_id, _encoder.encode(reply))

    def _control(self, peer: bytes, envelope: Envelope, message: Message) -> bool:
        """Answer a runtime control message; True when the actor must stop."""
        server = self._server
        reply: Message
        if isinstance(message, Ping):
            now = time.monotonic()
            busy = 0.0 if self._busy_since is None else now - self._busy_since
            reply = Pong(
                actor=self.name,
                pid=self._pid,
                uptime_s=now - self._started_at,
                busy_s=busy,
                queued=self._queued,
            )
        elif isinstance(message, StatsRequest):
            values = self.counters.as_dict()
            values["dropped_replies"] = server.dropped_replies
            values["malformed_frames"] = server.malformed_frames
            try:
                values.update(self.actor.stats())
            except Exception as exc:
                self.log.error("stats() failed", error=describe_exception(exc), exc_info=exc)
            reply = StatsReply(actor=self.name, values=values)
        else:
            self.log.info("shutdown requested", sender=envelope.sender)
            reply = Ack()
        if envelope.is_call:
            server.reply(peer, envelope.request_id, _encoder.encode(reply))
        return isinstance(message, Shutdown)

    def _log_handler_error(self, exc: Exception, message: Message, envelope: Envelope) -> None:
        fields = {
            "message": type(message).__name__,
            "sender": envelope.sender,
            "call": envelope.is_call,
            "error": describe_exception(exc),
        }
        if isinstance(exc, HandledError):
            self.log.warning("handler error", **fields)
        else:
            self.log.error("handler error", exc_info=exc, **fields)
