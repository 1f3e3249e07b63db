"""Actor runtime tests: ordered mailbox, call/send, failures, malformed frames, nested calls,
timeouts, control messages and background tasks, with real actors over real inproc sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import msgspec
import pytest
from anyio.abc import TaskStatus

from actors.runtime import (
    Actor,
    ActorCell,
    CrashReport,
    RefBook,
    RemoteError,
    UnexpectedReply,
)
from tests.actors.probe_actors import (
    FailingStartActor,
    ProbeActor,
    ProbeBadReply,
    ProbeEcho,
    ProbeEchoReply,
    ProbeFail,
    ProbeFailHandled,
    ProbeGetLog,
    ProbeGetTicks,
    ProbeLog,
    ProbeRecord,
    ProbeRelay,
    ProbeSleep,
    ProbeSum,
    ProbeTicks,
    ProbeTotal,
    TickerActor,
)
from transport.address import endpoint_for, new_system_id
from transport.channel import ClientChannel, ServerChannel
from transport.codec import any_message_codec
from transport.messages import (
    Ack,
    ErrorReply,
    Ping,
    Pong,
    Shutdown,
    StatsReply,
    StatsRequest,
)

pytestmark = pytest.mark.anyio


@dataclass
class Harness:
    """Actors running in cells on inproc mailboxes, plus refs sending as ``tester``."""

    directory: dict[str, str]
    cells: dict[str, ActorCell] = field(default_factory=dict)
    reports: dict[str, CrashReport | None] = field(default_factory=dict)
    finished: dict[str, anyio.Event] = field(default_factory=dict)
    refs: RefBook | None = None

    def ref(self, name: str):  # type: ignore[no-untyped-def]
        assert self.refs is not None
        return self.refs.ref(name)

    async def finished_report(self, name: str, timeout: float = 5.0) -> CrashReport | None:
        with anyio.fail_after(timeout):
            await self.finished[name].wait()
        return self.reports[name]


@asynccontextmanager
async def running(actors: dict[str, Actor]) -> AsyncIterator[Harness]:
    system_id = new_system_id()
    harness = Harness({name: endpoint_for(name, "inproc", system_id) for name in actors})
    harness.refs = RefBook(harness.directory, sender="tester", call_timeout_s=5.0)
    mailboxes = []

    async def run_cell(name: str, cell: ActorCell, *, task_status: TaskStatus[None]) -> None:
        harness.reports[name] = await cell.run(task_status=task_status)
        harness.finished[name].set()

    try:
        async with anyio.create_task_group() as tg:
            for name, actor in actors.items():
                actor.name = name
                mailbox = ServerChannel(harness.directory[name])
                mailboxes.append(mailbox)
                cell = ActorCell(actor, mailbox, harness.directory, stop_timeout_s=2.0)
                harness.cells[name] = cell
                harness.finished[name] = anyio.Event()
                await tg.start(run_cell, name, cell)
            try:
                yield harness
            finally:
                for cell in harness.cells.values():
                    cell.stop()
    finally:
        harness.refs.close()
        for mailbox in mailboxes:
            mailbox.close()


async def test_messages_are_handled_one_at_a_time_in_arrival_order() -> None:
    async with running({"probe": ProbeActor()}) as h:
        probe = h.ref("probe")
        for seq in range(500):
            await probe.send(ProbeRecord(seq=seq))
        log = await probe.call(ProbeGetLog(), expect=ProbeLog)
        assert log.values == list(range(500))


async def test_call_and_send() -> None:
    async with running({"probe": ProbeActor()}) as h:
        probe = h.ref("probe")
        reply = await probe.call(ProbeEcho(text="hi"))
        assert reply == ProbeEchoReply(text="hi", sender="tester")
        assert await probe.call(ProbeRecord(seq=1)) == Ack()  # None from handle -> Ack
        await probe.send(ProbeRecord(seq=2))
        total = await probe.call(ProbeSum(values=[1, 2, 3, 4]), expect=ProbeTotal)
        assert total.total == 10  # a hot (array-encoded) message in the same inbox
        assert (await probe.call(ProbeGetLog(), expect=ProbeLog)).values == [1, 2]


async def test_exception_in_a_call_becomes_remote_error_and_actor_keeps_serving() -> None:
    async with running({"probe": ProbeActor()}) as h:
        probe = h.ref("probe")
        with pytest.raises(RemoteError) as raised:
            await probe.call(ProbeFail(reason="boom"))
        assert raised.value.reply.code == "handler_error"
        assert "RuntimeError: boom" in raised.value.reply.message
        assert "Traceback" in raised.value.reply.detail
        assert (await probe.call(ProbeEcho(text="after"), expect=ProbeEchoReply)).text == "after"
        stats = await probe.call(StatsRequest(), expect=StatsReply)
        assert stats.values["handler_errors"] == 1
        assert not h.finished["probe"].is_set()


async def test_handled_error_in_a_send_does_not_crash() -> None:
    async with running({"probe": ProbeActor()}) as h:
        probe = h.ref("probe")
        await probe.send(ProbeFailHandled(reason="expected"))
        with pytest.raises(RemoteError):
            await probe.call(ProbeFailHandled(reason="expected too"))
        assert (await probe.call(ProbeEcho(text="ok"), expect=ProbeEchoReply)).text == "ok"
        stats = await probe.call(StatsRequest(), expect=StatsReply)
        assert stats.values["handler_errors"] == 2
        assert stats.values["sends"] == 1 and stats.values["calls"] == 2  # control not counted


async def test_unhandled_exception_in_a_send_crashes_the_actor() -> None:
    probe_actor = ProbeActor()
    async with running({"probe": probe_actor}) as h:
        await h.ref("probe").send(ProbeFail(reason="fatal"))
        report = await h.finished_report("probe")
    assert report is not None
    assert "RuntimeError: fatal" in report.error
    assert "ProbeFail" in report.error
    assert "raise RuntimeError(reason)" in report.traceback


async def test_malformed_frames_get_an_error_reply_and_never_crash_the_loop() -> None:
    async with running({"probe": ProbeActor()}) as h:
        raw = ClientChannel(h.directory["probe"], sender="raw")
        try:
            replies = [
                any_message_codec().decode(await raw.call(payload, timeout=5))
                for payload in (
                    b"\xc1garbage",
                    msgspec.msgpack.encode({"type": "ProbeEcho"}),  # missing field
                    msgspec.msgpack.encode(ProbeTicks(ticks=1, incarnation=1)),  # not in inbox
                    b"",
                )
            ]
            await raw.send(b"\x93\x01", timeout=5)  # fire-and-forget garbage: no reply
        finally:
            raw.close()
        assert all(isinstance(r, ErrorReply) and r.code == "bad_message" for r in replies)
        assert [r.message.split(":")[0] for r in replies] == [  # type: ignore[union-attr]
            "garbage",
            "missing_field",
            "unknown_tag",
            "empty",
        ]
        probe = h.ref("probe")
        assert (await probe.call(ProbeEcho(text="alive"), expect=ProbeEchoReply)).text == "alive"
        stats = await probe.call(StatsRequest(), expect=StatsReply)
        assert stats.values["decode_failures"] == 5


async def test_nested_call_while_handling_does_not_deadlock() -> None:
    async with running({"a": ProbeActor(), "b": ProbeActor(), "c": ProbeActor()}) as h:
        with anyio.fail_after(5):
            reply = await h.ref("a").call(ProbeRelay(target="b", text="x"), expect=ProbeEchoReply)
            assert reply == ProbeEchoReply(text="relayed:x", sender="a")
            # Two relays through one actor at once, in opposite directions.
            results: list[str] = []

            async def relay(src: str, dst: str) -> None:
                r = await h.ref(src).call(ProbeRelay(target=dst, text=src), expect=ProbeEchoReply)
                results.append(r.text)

            async with anyio.create_task_group() as tg:
                tg.start_soon(relay, "a", "c")
                tg.start_soon(relay, "b", "c")
            assert sorted(results) == ["relayed:a", "relayed:b"]


async def test_call_timeout_and_recovery() -> None:
    async with running({"probe": ProbeActor()}) as h:
        probe = h.ref("probe")
        started = anyio.current_time()
        with pytest.raises(TimeoutError, match="probe"):
            await probe.call(ProbeSleep(seconds=0.5), timeout=0.1)
        assert anyio.current_time() - started < 0.4
        # The mailbox is busy with the sleep, yet a Ping is answered at once, saying so.
        pong = await probe.ping(timeout=0.1)
        assert pong.busy_s > 0.0 and pong.queued == 0
        # Once the sleep ends the actor serves again, in order.
        reply = await probe.call(ProbeEcho(text="later"), expect=ProbeEchoReply, timeout=5)
        assert reply.text == "later"


async def test_reply_type_checks() -> None:
    async with running({"probe": ProbeActor()}) as h:
        probe = h.ref("probe")
        with pytest.raises(RemoteError) as raised:
            await probe.call(ProbeBadReply())
        assert raised.value.reply.code == "bad_reply"
        with pytest.raises(UnexpectedReply):
            await probe.call(ProbeEcho(text="x"), expect=ProbeTotal)
        with pytest.raises(KeyError, match="nobody"):
            h.ref("nobody")


async def test_ping_stats_and_shutdown_are_answered_by_the_runtime() -> None:
    probe_actor = ProbeActor()
    stopped: list[str] = []

    async def on_stop() -> None:
        stopped.append("probe")

    probe_actor.on_stop = on_stop  # type: ignore[method-assign]
    async with running({"probe": probe_actor}) as h:
        probe = h.ref("probe")
        pong = await probe.call(Ping(), expect=Pong)
        assert pong.actor == "probe" and pong.uptime_s >= 0
        await probe.send(ProbeRecord(seq=5))
        stats = await probe.call(StatsRequest(), expect=StatsReply)
        assert stats.values["log_length"] == 1  # the actor's own stats() merged in
        assert stats.values["handled"] == 1
        # Only the actor system may stop an actor: anyone else's Shutdown is refused.
        with pytest.raises(RemoteError, match="supervisor only"):
            await probe.call(Shutdown(reason="intruder"))
        assert (await probe.call(ProbeEcho(text="still"), expect=ProbeEchoReply)).text == "still"
        system = RefBook(h.directory, sender="system", call_timeout_s=5.0)
        assert await system.ref("probe").call(Shutdown(reason="test")) == Ack()
        system.close()
        assert await h.finished_report("probe") is None
        assert stopped == ["probe"]


async def test_background_timer_runs_and_its_failure_crashes_the_actor() -> None:
    async with running({"ticker": TickerActor(interval_s=0.01)}) as h:
        await anyio.sleep(0.2)
        ticks = await h.ref("ticker").call(ProbeGetTicks(), expect=ProbeTicks)
        assert ticks.ticks >= 5
    async with running({"ticker": TickerActor(interval_s=0.01, fail_on_tick=3)}) as h:
        report = await h.finished_report("ticker")
    assert report is not None and "tick 3 failed" in report.error


async def test_on_start_failure_is_a_crash_report() -> None:
    actor = FailingStartActor()
    actor.name = "bad"
    mailbox = ServerChannel(endpoint_for("bad", "inproc", new_system_id()))
    try:
        report = await ActorCell(actor, mailbox, {}).run()
    finally:
        mailbox.close()
    assert report is not None and "cannot start" in report.error


async def test_stop_cancels_a_busy_handler_and_runs_on_stop() -> None:
    probe_actor = ProbeActor()
    async with running({"probe": probe_actor}) as h:
        await h.ref("probe").send(ProbeSleep(seconds=30))
        await anyio.sleep(0.05)
        h.cells["probe"].stop()
        assert await h.finished_report("probe", timeout=2) is None
