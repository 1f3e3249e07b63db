"""Limits a public server needs, probed on a real server with small limits: request heads
and bodies that do not arrive in time (slow loris, a short body, a silent connection), a
connection cap, a bounded waiting queue (429 with Retry-After on HTTP, "overloaded" on
ZeroMQ), an oversized prompt refused by its length, the Bearer scheme in any case, user
values echoed only truncated, and CURVE on the ZeroMQ endpoint."""

from __future__ import annotations

import socket
import time

import anyio
import httpx
import pytest

from tests.e2e.server_fixtures import MODEL_NAME, start_server, stop_server, wait_idle
from transport.client import KvactorClient, KvactorError
from transport.messages.client import ERR_OVERLOADED
from transport.messages.engine import GenerationParams
from transport.security import write_curve_keypair

pytestmark = [pytest.mark.model]

MAX_CONNECTIONS = 24
RUNNING, WAITING = 2, 2


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    keys = tmp_path_factory.mktemp("zmq-keys")
    public, secret = write_curve_keypair(str(keys))
    handle = start_server(
        extra=[
            "model.dtype=auto",
            "model.threads=0",
            "server.header_timeout_s=1.0",
            "server.body_timeout_s=1.0",
            f"server.max_connections={MAX_CONNECTIONS}",
            f"scheduler.max_running_requests={RUNNING}",
            f"scheduler.max_waiting_requests={WAITING}",
            "kv.max_rows=4",
        ],
        args=["--zmq-curve-secret", secret],
    )
    handle.zmq_public_key = open(public).read().strip()
    try:
        yield handle
    finally:
        stop_server(handle)


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; (bytes, seconds until the close)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        pass
    return data, time.monotonic() - t0


def test_a_silent_connection_is_closed_with_408(limited):
    with _connect(limited) as sock:
        data, took = _read_until_closed(sock, 8)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert took < 8


def test_a_slow_loris_head_is_cut_off(limited):
    with _connect(limited) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 40
        t0 = time.monotonic()
        closed = False
        for byte in head:  # a byte every 0.1 s: 5 s for the head, the deadline is 1 s
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
        data, _ = _read_until_closed(sock, 8)
    assert closed or data.startswith(b"HTTP/1.1 408"), data
    assert time.monotonic() - t0 < 10


def test_a_body_shorter_than_its_content_length_gets_408(limited):
    with _connect(limited) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {limited.api_key}\r\n".encode()
            + b'content-length: 100\r\n\r\n{"prompt": '
        )
        data, took = _read_until_closed(sock, 8)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert b"request_timeout" in data
    assert took < 8


def test_connections_beyond_the_cap_are_refused_with_503(limited):
    socks = [_connect(limited) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        refused = 0
        for sock in socks[MAX_CONNECTIONS:]:
            data, _ = _read_until_closed(sock, 0.5)
            refused += data.startswith(b"HTTP/1.1 503")
        assert refused == 4
    finally:
        for sock in socks:
            sock.close()
    # The cap frees up as connections go: the server still serves.
    assert httpx.get(f"{limited.base_url}/health", timeout=10).status_code == 200


def test_a_full_queue_answers_429_with_retry_after(limited):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 32}
    statuses: list[httpx.Response] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=limited.base_url, timeout=120) as client:

            async def one() -> None:
                statuses.append(
                    await client.post("/v1/completions", json=body, headers=limited.auth)
                )

            async with anyio.create_task_group() as tg:
                for _ in range(12):
                    tg.start_soon(one)

    anyio.run(run)
    codes = sorted(r.status_code for r in statuses)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) <= RUNNING + WAITING + 4  # some finish while others arrive
    for r in statuses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
    wait_idle(limited)


def test_a_full_queue_answers_overloaded_on_zeromq(limited):
    outcomes: list[str] = []

    async def run() -> None:
        async with KvactorClient(
            limited.zmq_address, api_key=limited.api_key, server_key=limited.zmq_public_key
        ) as client:

            async def one(i: int) -> None:
                try:
                    await client.complete(
                        prompt=f"Story {i}:", params=GenerationParams(max_tokens=32)
                    )
                    outcomes.append("ok")
                except KvactorError as exc:
                    outcomes.append(exc.code)

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)

    anyio.run(run)
    assert set(outcomes) == {"ok", ERR_OVERLOADED}, outcomes
    wait_idle(limited)


def test_zeromq_without_the_servers_curve_key_gets_nothing(limited):
    async def run() -> None:
        async with KvactorClient(
            limited.zmq_address, api_key=limited.api_key, frame_timeout_s=2.0
        ) as client:
            with pytest.raises(TimeoutError):
                await client.complete(prompt="hi", params=GenerationParams(max_tokens=2))

    anyio.run(run)


def test_an_oversized_prompt_is_refused_cheaply(limited):
    prompt = "word " * 380_000  # ~1.9 MB, under the body cap
    resp = httpx.post(
        f"{limited.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4},
        headers=limited.auth,
        timeout=60,
    )
    assert resp.status_code == 400, resp.text[:300]
    assert "characters" in resp.json()["error"]["message"]  # refused before tokenizing


def test_bearer_scheme_is_case_insensitive(limited):
    for scheme in ("bearer", "BEARER", "Bearer"):
        headers = {"Authorization": f"{scheme} {limited.api_key}"}
        resp = httpx.get(f"{limited.base_url}/v1/models", headers=headers, timeout=10)
        assert resp.status_code == 200, (scheme, resp.text)
    resp = httpx.get(
        f"{limited.base_url}/v1/models",
        headers={"Authorization": f"Basic {limited.api_key}"},
        timeout=10,
    )
    assert resp.status_code == 401


def test_echoed_user_values_are_truncated(limited):
    huge = "m" * 1_000_000
    resp = httpx.post(
        f"{limited.base_url}/v1/completions",
        json={"model": huge, "prompt": "x", "max_tokens": 1},
        headers=limited.auth,
        timeout=60,
    )
    assert resp.status_code == 404 and len(resp.content) < 2000, len(resp.content)
    resp = httpx.get(f"{limited.base_url}/{'p' * 60_000}", timeout=10)
    assert resp.status_code == 404 and len(resp.content) < 2000, len(resp.content)
