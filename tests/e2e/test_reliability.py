"""The reliability suite: a real server under churn, faults and shutdown (loopback only,
every loop bounded in count and time).

* churn: 100 concurrent streams on a small KV pool, 20 closed mid-stream and 10 cut by a
  TCP reset, while /health is polled every 250 ms: every poll is 200, every request that
  was not cut completes, and the KV is back to idle (pages, rows, records) within 2 s;
* SIGTERM under load: the server drains (new requests 503, /health 503 "draining"), the
  requests that can finish within the grace period do, the rest end with an error event
  and `[DONE]`, and the process exits 0 leaving no process behind;
* kill -9 of the runner's process under load: every client gets an error (never a hang);
  with `engine.runner_on_crash = "shutdown"` the server exits 1 with no orphan, with
  "restart" it serves again (a fresh runner, the prefix cache dropped, the pool whole).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field

import anyio
import httpx
import pytest

from tests.e2e.engine_fixtures import natural_text
from tests.e2e.server_fixtures import (
    MODEL_NAME,
    STOP_TIMEOUT_S,
    ServerHandle,
    engine_figures,
    is_idle,
    session_gone,
    start_server,
    stop_server,
    wait_idle,
)

pytestmark = [pytest.mark.model]

FAST = ["model.dtype=auto", "model.threads=0"]  # this suite compares no texts


@dataclass
class StreamResult:
    events: list[dict] = field(default_factory=list)
    done: bool = False  # "data: [DONE]" arrived
    status: int = 0

    @property
    def finish_reason(self) -> str | None:
        for event in self.events:
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    return choice["finish_reason"]
        return None

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)


def _body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(
    client: httpx.AsyncClient,
    server: ServerHandle,
    body: dict,
    *,
    leave_after: int | None = None,
    first_event: anyio.Event | None = None,
) -> StreamResult:
    out = StreamResult()
    async with client.stream("POST", "/v1/completions", json=body, headers=server.auth) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            out.events.append(json.loads(line[6:]))
            if first_event is not None:
                first_event.set()
            if leave_after is not None and len(out.events) >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return out


async def _reset_mid_stream(server: ServerHandle, body: dict) -> None:
    """Send a streaming request, read its first bytes, then drop the connection with a TCP
    reset (SO_LINGER 0) instead of a clean close."""
    host, port = server.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {server.api_key}\r\n".encode()
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    seen = b""
    while b"data: " not in seen:
        chunk = await reader.read(4096)
        if not chunk:
            break
        seen += chunk
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def _poll_health(server: ServerHandle, statuses: list[int], stop: anyio.Event) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5.0) as client:
        while not stop.is_set():
            try:
                statuses.append((await client.get("/health")).status_code)
            except httpx.HTTPError:
                statuses.append(-1)
            with anyio.move_on_after(0.25):
                await stop.wait()


# ---- churn on a small pool -------------------------------------------------------------------

CHURN_STREAMS = 100
CHURN_CLOSES = 20
CHURN_RESETS = 10


@pytest.fixture(scope="module")
def small_server():
    # 160 pages of 16 tokens for 32 running requests: admission, retraction and eviction
    # are all exercised.
    handle = start_server(extra=[*FAST, "kv.num_pages=160"])
    try:
        yield handle
    finally:
        stop_server(handle)


def test_health_stays_up_and_kv_balances_under_churn(small_server):
    server = small_server
    text = natural_text()
    prompts = [text[i * 97 : i * 97 + 60 + (i % 5) * 40] for i in range(CHURN_STREAMS)]
    statuses: list[int] = []
    results: dict[int, StreamResult] = {}
    ended_at: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = _body(prompts[i], max_tokens=24)
        if i < CHURN_RESETS:
            await _reset_mid_stream(server, body)
        elif i < CHURN_RESETS + CHURN_CLOSES:
            await _stream(client, server, body, leave_after=2)
        else:
            results[i] = await _stream(client, server, body)
        ended_at.append(time.monotonic())

    async def run() -> None:
        stop = anyio.Event()
        limits = httpx.Limits(max_connections=CHURN_STREAMS)
        with anyio.fail_after(300):
            async with anyio.create_task_group() as outer:
                outer.start_soon(_poll_health, server, statuses, stop)
                async with httpx.AsyncClient(
                    base_url=server.base_url, limits=limits, timeout=120.0
                ) as client:
                    async with anyio.create_task_group() as tg:
                        for i in range(CHURN_STREAMS):
                            tg.start_soon(one, client, i)
                stop.set()

    anyio.run(run)
    assert len(ended_at) == CHURN_STREAMS
    assert len(statuses) >= 8 and set(statuses) == {200}, statuses
    completed = CHURN_STREAMS - CHURN_RESETS - CHURN_CLOSES
    assert len(results) == completed
    for i, res in results.items():
        assert res.status == 200 and res.done, (i, res)
        assert res.finish_reason == "length", (i, res.events[-1:])
    _figures, waited = wait_idle(server, timeout_s=2.0)  # raises past 2 s
    figures = engine_figures(server)
    assert figures["kvactor:kv_held_rows"] == 0 and figures["kvactor:kv_request_records"] == 0
    free, tree = (
        figures['kvactor:kv_pages{state="free"}'],
        figures['kvactor:kv_pages{state="tree"}'],
    )
    assert free + tree == 160


# ---- SIGTERM under load ---------------------------------------------------------------------


def test_sigterm_drains_then_exits_zero():
    server = start_server(extra=[*FAST, "server.drain_timeout_s=6"])
    short: list[StreamResult] = []
    long: list[StreamResult] = []
    after: dict[str, object] = {}

    async def run() -> None:
        started = [anyio.Event() for _ in range(6)]
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:

            async def keep(out: list, body: dict, ev: anyio.Event) -> None:
                out.append(await _stream(client, server, body, first_event=ev))

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(keep, short, _body(f"Story {i}:", 6), started[i])
                    for i in range(3):
                        tg.start_soon(keep, long, _body(f"Essay {i}:", 1500), started[3 + i])
                    for ev in started:
                        await ev.wait()
                    server.process.send_signal(signal.SIGTERM)
                    await anyio.sleep(0.5)
                    fresh = await client.post(
                        "/v1/completions", json=_body("late", 4, stream=False), headers=server.auth
                    )
                    after["status"], after["body"] = fresh.status_code, fresh.json()
                    health = await client.get("/health")
                    after["health"] = (health.status_code, health.json())

    try:
        anyio.run(run)
        code = server.process.wait(timeout=6 + STOP_TIMEOUT_S)
    finally:
        stop_server(server, check=False)
    assert after["status"] == 503 and after["body"]["error"]["code"] == "shutting_down"
    assert after["health"] == (503, {"status": "draining"})
    assert len(short) == 3 and all(r.done and r.finish_reason == "length" for r in short)
    assert len(long) == 3
    for r in long:  # cut by the end of the grace period: told so, then [DONE]
        assert r.done and r.finish_reason is None, r.events[-1:]
        assert "shut down" in r.error["message"], r.error
    assert code == 0, server.log_tail()
    assert session_gone(server.process.pid)


# ---- kill -9 of the runner process ----------------------------------------------------------


def _runner_pid(server: ServerHandle) -> int:
    """The spawned child process that hosts the runner group."""
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.process.pid)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if "multiprocessing.spawn" in line]
    assert len(pids) == 1, out
    return pids[0]


def _rank_pids(server: ServerHandle) -> list[int]:
    """Rank 1 of a tensor-parallel runner: the server's child `kernels.tensor_parallel`."""
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.process.pid)],
        capture_output=True,
        text=True,
        check=False,  # ps exits 1 when the server has no child
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "kernels.tensor_parallel" in line]


def _rank_pid(server: ServerHandle) -> int:
    pids = _rank_pids(server)
    assert len(pids) == 1, pids
    return pids[0]


async def _load_then_kill(
    server: ServerHandle, victim=_runner_pid
) -> tuple[list[StreamResult], list[httpx.Response]]:
    streams: list[StreamResult] = []
    plain: list[httpx.Response] = []
    started = [anyio.Event() for _ in range(4)]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:

        async def stream(i: int) -> None:
            streams.append(
                await _stream(client, server, _body(f"Tale {i}:", 1500), first_event=started[i])
            )

        async def whole(i: int) -> None:
            body = _body(f"Poem {i}:", 1500, stream=False)
            plain.append(await client.post("/v1/completions", json=body, headers=server.auth))

        with anyio.fail_after(60):  # every client hears back: nobody hangs
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(stream, i)
                for i in range(2):
                    tg.start_soon(whole, i)
                for ev in started:
                    await ev.wait()
                os.kill(victim(server), signal.SIGKILL)
    return streams, plain


MULTI_PROCESS = ["engine.transport=ipc", "engine.groups.runner=model"]


def _wait_serving(server: ServerHandle, ready) -> None:
    """Until `ready()` and /health is 200 (at most 120 s)."""
    deadline = time.monotonic() + 120
    while not ready() or httpx.get(f"{server.base_url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.25)


def _assert_completes(server: ServerHandle) -> None:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json=_body("After the crash:", 8, stream=False),
        headers=server.auth,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def _killed_under_load_exits_one(extra: list[str], victim) -> str:
    """Kill `victim(server)` under load with the shutdown policy: every client hears an
    error, the server exits 1 and leaves no process behind; its log tail."""
    server = start_server(extra=extra)
    try:
        streams, plain = anyio.run(_load_then_kill, server, victim)
        code = server.process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        stop_server(server, check=False)
    assert len(streams) == 4 and len(plain) == 2
    for r in streams:
        assert r.done and r.error is not None and r.finish_reason is None, r.events[-1:]
    for resp in plain:
        assert resp.status_code == 503, resp.text
    assert code == 1, server.log_tail()
    assert session_gone(server.process.pid)  # no orphan: the runner's processes are gone too
    return server.log_tail()


def test_runner_killed_with_shutdown_policy_errors_every_client_and_exits_one():
    _killed_under_load_exits_one([*FAST, *MULTI_PROCESS], _runner_pid)


def test_runner_killed_with_restart_policy_serves_again():
    server = start_server(extra=[*FAST, *MULTI_PROCESS, "engine.runner_on_crash=restart"])
    try:
        old_pid = _runner_pid(server)
        streams, plain = anyio.run(_load_then_kill, server)
        for r in streams:
            assert r.done and r.error is not None, r.events[-1:]
            assert "runner failed" in r.error["message"], r.error
        for resp in plain:
            assert resp.status_code == 503, resp.text
        _wait_serving(server, lambda: True)
        assert _runner_pid(server) != old_pid
        _assert_completes(server)
        # A constrained request: its grammar, compiled in this process, is loaded by the
        # new runner process from the bytes the request carries.
        constrained = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                **_body("Pick a color:", 8, stream=False),
                "ignore_eos": False,
                "guided_choice": ["red", "blue"],
            },
            headers=server.auth,
            timeout=120,
        )
        assert constrained.status_code == 200, constrained.text
        assert constrained.json()["choices"][0]["text"] in ("red", "blue")
        figures, _ = wait_idle(server, timeout_s=10)
        assert is_idle(figures)
        assert server.process.poll() is None
    finally:
        stop_server(server)


# ---- kill -9 of a tensor-parallel rank ----------------------------------------------------

TWO_RANKS = ["parallel.tensor_parallel_size=2"]


def test_rank_killed_with_shutdown_policy_errors_every_client_and_exits_one():
    assert "tensor-parallel" in _killed_under_load_exits_one([*FAST, *TWO_RANKS], _rank_pid)


def test_rank_killed_with_restart_policy_serves_again():
    server = start_server(extra=[*FAST, *TWO_RANKS, "engine.runner_on_crash=restart"])
    try:
        old_pid = _rank_pid(server)
        streams, plain = anyio.run(_load_then_kill, server, _rank_pid)
        for r in streams:
            assert r.done and r.error is not None, r.events[-1:]
        for resp in plain:
            assert resp.status_code == 503, resp.text
        # a new group forms, with a new rank 1
        _wait_serving(server, lambda: _rank_pids(server) not in ([], [old_pid]))
        assert _rank_pid(server) != old_pid
        _assert_completes(server)
        figures, _ = wait_idle(server, timeout_s=10)
        assert is_idle(figures)
        assert server.process.poll() is None
    finally:
        stop_server(server)
    assert session_gone(server.process.pid)
