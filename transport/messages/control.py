"""Control-plane messages understood by the actor runtime itself (not by actor code).

Every actor inbox implicitly accepts ``Ping``, ``Shutdown`` and ``StatsRequest``; the runtime
answers them without calling ``Actor.handle``. ``Ack`` and ``ErrorReply`` are the generic
replies to a call; ``ActorCrashed`` is the notice a process host sends to the supervisor.
"""

from __future__ import annotations

from typing import Final

from transport.messages.base import Message


class Ping(Message):
    """Liveness probe; answered by the runtime with ``Pong`` in mailbox order."""


class Pong(Message):
    """Answered by the runtime at once, even while the actor handles a long message."""

    actor: str
    pid: int
    uptime_s: float
    busy_s: float = 0.0  # how long the message being handled has taken so far (0: idle)
    queued: int = 0  # messages waiting behind it


class Shutdown(Message):
    """Ask an actor to stop: it finishes the message in hand, runs ``on_stop`` and exits."""

    reason: str = ""


class Ack(Message):
    """The reply to a call whose handler returned ``None``."""


# ErrorReply.code values. New codes may be added; callers should treat unknown codes as errors.
ERR_HANDLER: Final = "handler_error"  # Actor.handle raised while serving a call
ERR_BAD_MESSAGE: Final = "bad_message"  # the payload failed to decode against the inbox
ERR_BAD_REPLY: Final = "bad_reply"  # the handler returned something that is not a Message
ERR_STOPPING: Final = "stopping"  # the actor is shutting down


class ErrorReply(Message):
    """The reply to a call that failed; ``ActorRef.call`` raises it as ``RemoteError``."""

    code: str
    message: str
    detail: str = ""


class ActorCrashed(Message):
    """Supervisor notice: actor ``name`` failed with ``error`` (in process ``pid``)."""

    name: str
    error: str
    traceback: str = ""
    pid: int = 0
    will_restart: bool = False


class PeerCrashed(Message):
    """System -> an actor in the crashed one's `crash_watchers`: `actor` failed with
    `error`; when `will_restart`, a fresh instance takes over its mailbox."""

    actor: str
    error: str
    will_restart: bool


class StatsRequest(Message):
    """Ask an actor for its counters; answered by the runtime with ``StatsReply``."""


class StatsReply(Message):
    actor: str
    values: dict[str, int | float] = {}


# Messages the runtime adds to every actor inbox and answers itself.
RuntimeControl = Ping | Shutdown | StatsRequest

ControlMessage = (
    Ping | Pong | Shutdown | Ack | ErrorReply | ActorCrashed | StatsRequest | StatsReply
)
