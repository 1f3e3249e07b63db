"""Small real actors and messages used by the runtime and supervisor tests.

They live in an importable module (not a test file) so that multi-process engines can build
them in spawned children. Message names carry a ``Probe`` prefix to stay unique in the
protocol-wide tag registry.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from actors.runtime import Actor, HandledError
from transport.channel import Envelope
from transport.messages.base import HotMessage, Message


class ProbeEcho(Message):
    text: str


class ProbeEchoReply(Message):
    text: str
    sender: str = ""


class ProbeRecord(Message):
    """Append ``seq`` to the actor's log (sent fire-and-forget or called)."""

    seq: int


class ProbeGetLog(Message):
    pass


class ProbeLog(Message):
    values: list[int]


class ProbeFail(Message):
    """Raise RuntimeError in handle (call -> ErrorReply; send -> crash)."""

    reason: str


class ProbeFailHandled(Message):
    """Raise HandledError in handle (never crashes the actor)."""

    reason: str


class ProbeSleep(Message):
    seconds: float


class ProbeRelay(Message):
    """While handling this call, call actor ``target`` with ProbeEcho(text)."""

    target: str
    text: str


class ProbeBadReply(Message):
    """The handler returns a non-message value."""


class ProbeSum(HotMessage):
    """An array-encoded (hot) message through the same inbox as map-encoded ones."""

    values: list[int]


class ProbeTotal(Message):
    total: int


class ProbeGetTicks(Message):
    pass


class ProbeTicks(Message):
    ticks: int
    incarnation: int


ProbeInbox = (
    ProbeEcho
    | ProbeRecord
    | ProbeGetLog
    | ProbeFail
    | ProbeFailHandled
    | ProbeSleep
    | ProbeRelay
    | ProbeBadReply
    | ProbeSum
)


class ProbeActor(Actor):
    """Echo, ordered log, failures on demand, nested calls, sleeps, hot-message sums.

    With ``marker_dir`` set it writes ``<name>.started`` / ``<name>.stopped`` files, so tests
    can see that lifecycle hooks ran in another process.
    """

    inbox = ProbeInbox

    def __init__(self, marker_dir: str | None = None) -> None:
        self.marker_dir = Path(marker_dir) if marker_dir else None
        self.log_values: list[int] = []

    def _mark(self, event: str) -> None:
        if self.marker_dir is not None:
            path = self.marker_dir / f"{self.name}.{event}"
            count = int(path.read_text()) + 1 if path.exists() else 1
            path.write_text(str(count))

    async def on_start(self) -> None:
        self._mark("started")

    async def on_stop(self) -> None:
        self._mark("stopped")

    def stats(self) -> dict[str, int | float]:
        return {"log_length": len(self.log_values)}

    async def handle(self, message: object, sender: Envelope) -> Message | None:
        match message:
            case ProbeEcho(text=text):
                return ProbeEchoReply(text=text, sender=sender.sender)
            case ProbeRecord(seq=seq):
                self.log_values.append(seq)
                return None
            case ProbeGetLog():
                return ProbeLog(values=list(self.log_values))
            case ProbeFail(reason=reason):
                raise RuntimeError(reason)
            case ProbeFailHandled(reason=reason):
                raise HandledError(reason)
            case ProbeSleep(seconds=seconds):
                await anyio.sleep(seconds)
                return None
            case ProbeRelay(target=target, text=text):
                reply = await self.ref(target).call(ProbeEcho(text=text), expect=ProbeEchoReply)
                return ProbeEchoReply(text=f"relayed:{reply.text}", sender=reply.sender)
            case ProbeBadReply():
                return "not a message"  # type: ignore[return-value]
            case ProbeSum(values=values):
                return ProbeTotal(total=sum(values))
        raise AssertionError(f"unexpected message {message!r}")


class TickerActor(Actor):
    """Counts ticks of a background timer; ``incarnation`` counts on_start calls per process."""

    inbox = ProbeGetTicks | ProbeFail
    incarnations = 0

    def __init__(self, interval_s: float = 0.01, fail_on_tick: int = 0) -> None:
        self.interval_s = interval_s
        self.fail_on_tick = fail_on_tick
        self.ticks = 0

    async def on_start(self) -> None:
        TickerActor.incarnations += 1
        self.every(self.interval_s, self._tick)

    async def _tick(self) -> None:
        self.ticks += 1
        if self.fail_on_tick and self.ticks == self.fail_on_tick:
            raise RuntimeError(f"tick {self.ticks} failed")

    async def handle(self, message: object, sender: Envelope) -> Message | None:
        if isinstance(message, ProbeGetTicks):
            return ProbeTicks(ticks=self.ticks, incarnation=TickerActor.incarnations)
        raise RuntimeError("ticker told to fail")


class FailingStartActor(Actor):
    """Raises in on_start."""

    inbox = ProbeEcho

    async def on_start(self) -> None:
        raise RuntimeError("cannot start")
