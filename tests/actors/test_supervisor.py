"""Supervisor tests: in-process and multi-process engines, crash policies, health, clean stop.

Multi-process engines spawn real children (multiprocessing "spawn") running the actors of
``tests/actors_for_tests.py``; each test checks that no child outlives the engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from actors.runtime import ActorSpec, ActorSystem, SystemStartError
from tests.actors.probe_actors import (
    FailingStartActor,
    ProbeActor,
    ProbeEcho,
    ProbeEchoReply,
    ProbeFail,
    ProbeGetTicks,
    ProbeRelay,
    ProbeSleep,
    ProbeTicks,
    TickerActor,
)
from transport.address import ipc_dir_for
from transport.channel import ChannelClosed

pytestmark = pytest.mark.anyio

PROBE = f"{ProbeActor.__module__}:ProbeActor"  # the "module:Class" factory form


def markers(directory: Path) -> dict[str, int]:
    return {path.name: int(path.read_text()) for path in sorted(directory.iterdir())}


def assert_processes_gone(engine: ActorSystem) -> None:
    for group, process in engine.processes.items():
        assert not process.is_alive(), f"child of group {group} is still alive"
        assert process.pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)  # reaped, not a zombie


async def test_in_process_start_call_health_stop(tmp_path: Path) -> None:
    specs = [
        ActorSpec("a", PROBE, kwargs={"marker_dir": str(tmp_path)}),
        ActorSpec("b", ProbeActor, kwargs={"marker_dir": str(tmp_path)}),
    ]
    async with ActorSystem(specs) as engine:
        assert markers(tmp_path) == {"a.started": 1, "b.started": 1}
        reply = await engine.ref("a").call(ProbeRelay(target="b", text="x"), expect=ProbeEchoReply)
        assert reply == ProbeEchoReply(text="relayed:x", sender="a")
        health = await engine.health()
        assert all(h.up and h.pid == os.getpid() for h in health.values())
    assert engine.stopped and engine.crash is None
    assert markers(tmp_path) == {"a.started": 1, "a.stopped": 1, "b.started": 1, "b.stopped": 1}
    with pytest.raises(ChannelClosed):
        engine.ref("a")
    health = await engine.health(timeout_s=0.1)
    assert not any(h.up for h in health.values())


async def test_health_tells_busy_from_stuck() -> None:
    async with ActorSystem([ActorSpec("a", ProbeActor), ActorSpec("b", ProbeActor)]) as engine:
        await engine.ref("a").send(ProbeSleep(seconds=1.0))
        await anyio.sleep(0.3)
        busy = await engine.health(timeout_s=0.2)
        assert busy["a"].up and busy["a"].busy_s >= 0.2 and busy["b"].up  # busy is not down
        stuck = await engine.health(timeout_s=0.2, stuck_after_s=0.2)
        assert not stuck["a"].up and "stuck" in stuck["a"].error and stuck["b"].up


async def test_in_process_crash_with_shutdown_policy_stops_the_engine(tmp_path: Path) -> None:
    specs = [
        ActorSpec("a", ProbeActor, kwargs={"marker_dir": str(tmp_path)}),
        ActorSpec("b", ProbeActor, kwargs={"marker_dir": str(tmp_path)}),
    ]
    async with ActorSystem(specs) as engine:
        await engine.ref("a").send(ProbeFail(reason="fatal"))
        with anyio.fail_after(5):
            crash = await engine.wait_stopped()
    assert crash is not None and crash.name == "a" and "fatal" in crash.error
    assert not crash.will_restart and "Traceback" in crash.traceback
    assert markers(tmp_path)["a.stopped"] == 1 and markers(tmp_path)["b.stopped"] == 1


async def test_in_process_restart_policy_then_restart_budget_exhausted() -> None:
    spec = ActorSpec("t", TickerActor, on_crash="restart", max_restarts=1, restart_backoff_s=0.01)
    async with ActorSystem([spec, ActorSpec("other", ProbeActor)]) as engine:
        ticker = engine.ref("t")
        first = await ticker.call(ProbeGetTicks(), expect=ProbeTicks)
        await ticker.send(ProbeFail(reason="crash 1"))
        with anyio.fail_after(5):
            second = await ticker.call(ProbeGetTicks(), expect=ProbeTicks)
        assert second.incarnation == first.incarnation + 1  # a fresh instance serves again
        assert not engine.stopped
        await ticker.send(ProbeFail(reason="crash 2"))  # over max_restarts -> shutdown
        with anyio.fail_after(5):
            crash = await engine.wait_stopped()
        assert crash is not None and crash.name == "t"


async def test_in_process_start_failure_raises_and_cleans_up() -> None:
    engine = ActorSystem([ActorSpec("ok", ProbeActor), ActorSpec("bad", FailingStartActor)])
    with anyio.fail_after(10), pytest.raises(SystemStartError, match="cannot start"):
        async with engine:
            pass
    assert engine.stopped


async def test_multi_process_ipc_start_nested_call_stop(tmp_path: Path) -> None:
    specs = [
        ActorSpec("local", ProbeActor, kwargs={"marker_dir": str(tmp_path)}, group="main"),
        ActorSpec("a", PROBE, kwargs={"marker_dir": str(tmp_path)}, group="left"),
        ActorSpec("b", ProbeActor, kwargs={"marker_dir": str(tmp_path)}, group="right"),
    ]
    engine = ActorSystem(specs, transport="ipc", local_groups={"main"})
    with anyio.fail_after(60):
        async with engine:
            assert ipc_dir_for(engine.system_id).is_dir()
            health = await engine.health()
            pids = {name: h.pid for name, h in health.items()}
            assert all(h.up for h in health.values())
            assert pids["local"] == os.getpid()
            assert len({pids["local"], pids["a"], pids["b"]}) == 3  # three processes
            # parent actor -> child a -> child b, across processes
            relay = await engine.ref("local").call(ProbeRelay(target="a", text="hop"))
            assert relay == ProbeEchoReply(text="relayed:hop", sender="local")
            chained = await engine.ref("a").call(ProbeRelay(target="b", text="x"))
            assert chained == ProbeEchoReply(text="relayed:x", sender="a")
    assert engine.crash is None
    assert_processes_gone(engine)
    assert all(process.exitcode == 0 for process in engine.processes.values())
    assert not ipc_dir_for(engine.system_id).exists()
    assert markers(tmp_path) == {
        f"{name}.{event}": 1 for name in ("a", "b", "local") for event in ("started", "stopped")
    }


async def test_multi_process_crash_with_shutdown_policy(tmp_path: Path) -> None:
    specs = [
        ActorSpec("a", ProbeActor, kwargs={"marker_dir": str(tmp_path)}, group="left"),
        ActorSpec("b", ProbeActor, kwargs={"marker_dir": str(tmp_path)}, group="right"),
    ]
    engine = ActorSystem(specs, transport="ipc")
    with anyio.fail_after(60):
        async with engine:
            await engine.ref("a").call(ProbeEcho(text="up"))
            await engine.ref("a").send(ProbeFail(reason="child fatal"))
            started = anyio.current_time()
            with anyio.fail_after(10):
                crash = await engine.wait_stopped()
            assert anyio.current_time() - started < 5.0
    assert crash is not None and crash.name == "a" and "child fatal" in crash.error
    assert_processes_gone(engine)
    assert not ipc_dir_for(engine.system_id).exists()
    assert markers(tmp_path)["a.stopped"] == 1 and markers(tmp_path)["b.stopped"] == 1


async def test_multi_process_tcp_restart_and_health_while_down() -> None:
    specs = [
        ActorSpec("t", TickerActor, group="work", on_crash="restart", restart_backoff_s=1.0),
        ActorSpec("p", ProbeActor, group="work"),
    ]
    engine = ActorSystem(specs, transport="tcp")
    with anyio.fail_after(60):
        async with engine:
            addresses = engine.directory.values()
            assert all(address.startswith("tcp://127.0.0.1:") for address in addresses)
            ticker = engine.ref("t")
            first = await ticker.call(ProbeGetTicks(), expect=ProbeTicks)
            await ticker.send(ProbeFail(reason="restart me"))
            await anyio.sleep(0.3)  # inside the 1 s restart backoff
            health = await engine.health(timeout_s=0.3)
            assert not health["t"].up and health["p"].up
            second = await ticker.call(ProbeGetTicks(), expect=ProbeTicks, timeout=10)
            assert second.incarnation == first.incarnation + 1
            assert (await engine.health())["t"].up
            assert not engine.stopped
    assert engine.crash is None
    assert_processes_gone(engine)


async def test_killed_child_process_shuts_the_engine_down() -> None:
    specs = [ActorSpec("a", ProbeActor, group="left"), ActorSpec("b", ProbeActor, group="right")]
    engine = ActorSystem(specs, transport="ipc")
    with anyio.fail_after(60):
        async with engine:
            victim = engine.processes["left"]
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            with anyio.fail_after(10):
                crash = await engine.wait_stopped()
    assert crash is not None and crash.name == "group:left"
    assert_processes_gone(engine)
    assert not ipc_dir_for(engine.system_id).exists()


async def test_sigterm_to_a_child_runs_on_stop_then_the_engine_shuts_down(tmp_path: Path) -> None:
    specs = [
        ActorSpec("a", ProbeActor, kwargs={"marker_dir": str(tmp_path)}, group="left"),
        ActorSpec("b", ProbeActor, kwargs={"marker_dir": str(tmp_path)}, group="right"),
    ]
    engine = ActorSystem(specs, transport="ipc")
    with anyio.fail_after(60):
        async with engine:
            pid = engine.processes["left"].pid
            assert pid is not None
            os.kill(pid, signal.SIGTERM)
            with anyio.fail_after(10):
                crash = await engine.wait_stopped()
    assert crash is not None and crash.name == "group:left" and "code 0" in crash.error
    assert markers(tmp_path)["a.stopped"] == 1 and markers(tmp_path)["b.stopped"] == 1
    assert_processes_gone(engine)


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (exited; a zombie nobody reaped counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


ORPHAN_SCRIPT = """
import anyio
from actors.runtime import ActorSpec, ActorSystem
from tests.actors.probe_actors import ProbeActor

async def main():
    specs = [ActorSpec("a", ProbeActor, group="left")]
    async with ActorSystem(specs, transport="ipc") as engine:
        print(engine.processes["left"].pid, engine.system_id, flush=True)
        await anyio.sleep(120)

anyio.run(main)
"""


def test_children_exit_when_the_parent_is_killed() -> None:
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pid_text, system_id = parent.stdout.readline().split()
        child_pid = int(pid_text)
        assert not _gone(child_pid) and ipc_dir_for(system_id).is_dir()
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child_pid), "the child outlived its killed parent"
        assert not ipc_dir_for(system_id).exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)


async def test_multi_process_bad_factory_fails_start_cleanly() -> None:
    specs = [
        ActorSpec("a", ProbeActor, group="left"),
        ActorSpec("b", "tests.no_such_module:Nope", group="right"),
    ]
    engine = ActorSystem(specs, transport="ipc")
    with anyio.fail_after(60), pytest.raises(SystemStartError, match="no_such_module"):
        async with engine:
            pass
    assert_processes_gone(engine)
    assert not ipc_dir_for(engine.system_id).exists()


INTRUDER_SCRIPT = """
import sys
import anyio
from actors.runtime.refs import RefBook
from transport.messages.control import Shutdown

async def main():
    book = RefBook({"p": sys.argv[1]}, sender="system", call_timeout_s=2.0)
    ref = book.ref("p")
    try:
        await ref.ping(timeout=2.0)
        print("answered")
    except Exception:  # a timeout, or the socket giving up: no answer either way
        print("no answer")
    try:
        await ref.call(Shutdown(reason="intruder"), timeout=2.0)
        print("shutdown taken")
    except Exception:
        print("no answer")
    book.close()

anyio.run(main)
"""


async def test_tcp_mailboxes_refuse_a_process_without_the_system_keys() -> None:
    """On tcp every mailbox is a CURVE server admitting only this system's processes: a
    local process that is not one of them (here claiming to be the system) gets no answer,
    not even to Ping, and its Shutdown never arrives."""
    root = Path(__file__).resolve().parents[2]
    specs = [ActorSpec("p", ProbeActor, group="work"), ActorSpec("q", ProbeActor)]
    engine = ActorSystem(specs, transport="tcp", local_groups={"main"})
    with anyio.fail_after(60):
        async with engine:
            for name in ("p", "q"):
                result = await anyio.run_process(
                    [sys.executable, "-c", INTRUDER_SCRIPT, engine.directory[name]],
                    cwd=root,
                    env={**os.environ, "PYTHONPATH": str(root)},
                    check=False,
                )
                out = result.stdout.decode().split()
                assert out == ["no", "answer", "no", "answer"], result.stderr.decode()[-2000:]
            health = await engine.health()
            assert health["p"].up and health["q"].up  # the system itself still gets through
            assert not engine.stopped
