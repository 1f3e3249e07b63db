"""`bench sessions --restart-after-turn`: the gate restarts the server once, after every
session either arrived or ended early, and only then lets the arrived ones go on."""

from __future__ import annotations

import asyncio

from actors.bench.sessions import RestartGate


def test_the_restart_waits_for_every_session_and_runs_once():
    events: list[str] = []

    async def scenario() -> None:
        async def restart() -> None:
            events.append("restart")

        gate = RestartGate(3, restart)

        async def session(name: str, delay: float, fails: bool = False) -> None:
            try:
                await asyncio.sleep(delay)
                if fails:
                    raise RuntimeError("its turn failed")
                await gate.arrive()
                events.append(f"{name} goes on")
            except RuntimeError:
                pass
            finally:
                gate.leave()

        await asyncio.wait_for(
            asyncio.gather(session("a", 0.0), session("b", 0.02), session("c", 0.01, True)), 5
        )

    asyncio.run(scenario())
    assert events[0] == "restart" and events.count("restart") == 1
    assert sorted(events[1:]) == ["a goes on", "b goes on"]


def test_a_failed_restart_is_raised_in_every_session_that_waited():
    outcomes: list[str] = []

    async def scenario() -> None:
        async def restart() -> None:
            raise OSError("the server did not come back")

        gate = RestartGate(2, restart)

        async def session(delay: float) -> None:
            await asyncio.sleep(delay)
            try:
                await gate.arrive()
                outcomes.append("went on")
            except RuntimeError as exc:
                outcomes.append(type(exc.__cause__).__name__)

        await asyncio.wait_for(asyncio.gather(session(0.0), session(0.01)), 5)

    asyncio.run(scenario())
    assert outcomes == ["OSError", "OSError"]
