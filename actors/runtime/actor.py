"""The ``Actor`` base class and the decoder of an actor's inbox."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol

import anyio
from structlog.typing import FilteringBoundLogger

from actors.runtime.refs import ActorRef, RefBook
from transport.channel import Envelope
from transport.codec import Codec, flatten_message_types
from transport.messages.base import Message
from transport.messages.control import RuntimeControl


class ActorServices(Protocol):
    """What an actor asks of the runtime that runs it: refs to its peers, tasks beside its
    mailbox, its logger. `actors.runtime.cell.ActorCell` provides them and binds itself as
    the actor's ``_cell``."""

    refs: RefBook
    log: FilteringBoundLogger

    def spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


class DeferredReply:
    """Returned by ``handle`` to answer a call later: the runtime runs ``work`` as a task of
    the actor and replies with its result (an exception becomes an ``ErrorReply``, as from
    ``handle``), while the mailbox goes on with the next message. Made by ``reply_later``."""

    __slots__ = ("work",)

    def __init__(self, work: Callable[[], Awaitable[Message | None]]) -> None:
        self.work = work


class Actor:
    """Base class of every actor. Subclasses set ``inbox`` and implement ``handle``.

    ``handle`` is called strictly one message at a time, in arrival order. For a call, the
    returned message is the reply (``None`` -> ``Ack``; ``reply_later(...)`` -> the reply of
    work that runs beside the mailbox, for a slow answer). The runtime binds ``name`` (from the
    spec) before ``on_start``; ``ref``, ``spawn``, ``every`` and ``log`` are usable from
    ``on_start`` on.
    """

    name: str = ""
    # A message class, a Union / ``A | B`` of them, or a tuple. Ping, Shutdown and
    # StatsRequest are always accepted in addition (the runtime answers them).
    inbox: ClassVar[Any] = ()

    _cell: ActorServices | None = None

    async def on_start(self) -> None:
        """Called once before the first message. Raising here crashes the actor."""

    async def on_stop(self) -> None:
        """Called once on shutdown or after a crash (bounded by a timeout, shielded)."""

    async def handle(self, message: Any, sender: Envelope) -> Message | None:
        raise NotImplementedError(f"{type(self).__name__} does not handle {type(message)}")

    def stats(self) -> dict[str, int | float]:
        """Actor-specific counters, merged into the runtime's ``StatsReply``."""
        return {}

    # Runtime services -------------------------------------------------------------------

    def ref(self, name: str) -> ActorRef:
        """A ref to another actor of the engine, sending as this actor (cached)."""
        return self._bound_cell().refs.ref(name)

    def optional_ref(self, name: str | None) -> ActorRef | None:
        """`ref(name)`, or None when the engine runs no actor of that name."""
        if not name:
            return None
        try:
            return self.ref(name)
        except KeyError:
            return None

    def spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``function(*args)`` in this actor's task group. It is cancelled when the actor
        stops; if it raises, the actor crashes."""
        self._bound_cell().spawn(function, *args)

    def reply_later(
        self, function: Callable[..., Awaitable[Message | None]], *args: Any
    ) -> DeferredReply:
        """For ``handle`` to return: the call is answered by ``function(*args)``, run as a task
        of this actor, so the mailbox is not held while it waits (a compile, a slow peer).
        Invariant: every call still gets exactly one reply."""
        return DeferredReply(lambda: function(*args))

    def every(self, interval_s: float, function: Callable[[], Awaitable[Any]]) -> None:
        """Call ``function()`` every ``interval_s`` seconds (drift-free) in the background."""
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")

        async def tick() -> None:
            deadline = anyio.current_time()
            while True:
                deadline += interval_s
                await anyio.sleep_until(deadline)
                await function()

        self.spawn(tick)

    @property
    def log(self) -> FilteringBoundLogger:
        return self._bound_cell().log

    def _bound_cell(self) -> ActorServices:
        cell = self._cell
        if cell is None:
            raise RuntimeError(f"actor {type(self).__name__} is not running in a runtime")
        return cell


_inbox_codecs: dict[type[Actor], Codec[Message]] = {}


def inbox_codec(actor_type: type[Actor]) -> Codec[Message]:
    """The decoder of an actor class's inbox plus the runtime control messages (cached)."""
    codec = _inbox_codecs.get(actor_type)
    if codec is None:
        declared = () if actor_type.inbox == () else flatten_message_types(actor_type.inbox)
        codec = Codec((*declared, *flatten_message_types(RuntimeControl)))
        _inbox_codecs[actor_type] = codec
    return codec
