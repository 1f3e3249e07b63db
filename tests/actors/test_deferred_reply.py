"""`Actor.reply_later`: a call answered by work that runs beside the mailbox (the tokenizer's
grammar compiles, the runner's grammar loads). The mailbox serves other messages meanwhile;
the call gets exactly one reply, its result, or an ErrorReply when the work raises (the
actor serves on)."""

from __future__ import annotations

import time

import anyio
import pytest

from actors.runtime import Actor, ActorSpec, ActorSystem, RemoteError
from tests.actors.probe_actors import ProbeEcho, ProbeEchoReply, ProbeFail, ProbeSleep


class Deferring(Actor):
    inbox = ProbeEcho | ProbeSleep | ProbeFail

    async def handle(self, msg, sender):
        if isinstance(msg, ProbeSleep):
            return self.reply_later(self._slow, msg.seconds)
        if isinstance(msg, ProbeFail):
            return self.reply_later(self._fail, msg.reason)
        return ProbeEchoReply(text=msg.text)

    async def _slow(self, seconds: float) -> ProbeEchoReply:
        await anyio.sleep(seconds)
        return ProbeEchoReply(text=f"slept {seconds}")

    async def _fail(self, reason: str) -> None:
        await anyio.sleep(0)
        raise RuntimeError(reason)


def test_a_deferred_reply_leaves_the_mailbox_free_and_errors_reach_the_caller():
    async def go():
        async with ActorSystem([ActorSpec("d", Deferring)], transport="inproc") as system:
            ref = system.ref("d")
            got: list[str] = []

            async def slow() -> None:
                got.append((await ref.call(ProbeSleep(seconds=1.0), expect=ProbeEchoReply)).text)

            async with anyio.create_task_group() as tg:
                tg.start_soon(slow)
                await anyio.sleep(0.05)
                t0 = time.monotonic()
                echo = await ref.call(ProbeEcho(text="hi"), expect=ProbeEchoReply)
                assert echo.text == "hi" and time.monotonic() - t0 < 0.5
            assert got == ["slept 1.0"]
            with pytest.raises(RemoteError, match="boom"):
                await ref.call(ProbeFail(reason="boom"))
            assert (await ref.call(ProbeEcho(text="still"), expect=ProbeEchoReply)).text == "still"
            health = await system.health()
            assert all(h.up for h in health.values())

    anyio.run(go)
