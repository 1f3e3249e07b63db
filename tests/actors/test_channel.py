"""Channel tests over inproc, ipc and tcp: request/reply, fire-and-forget, correlation under
many concurrent calls, timeouts, malformed frames and clean close (no leaked sockets)."""

from __future__ import annotations

import random
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from transport.address import (
    IpcDirectory,
    endpoint_for,
    ipc_path_of,
    new_system_id,
    transport_of,
)
from transport.channel import (
    KIND_CALL,
    KIND_SEND,
    ChannelClosed,
    ClientChannel,
    Envelope,
    ServerChannel,
    encode_envelope,
)

pytestmark = pytest.mark.anyio

TRANSPORTS = ["inproc", "ipc", "tcp"]


@pytest.fixture
def context() -> Iterator[zmq.asyncio.Context]:
    """A private context per test. ``term()`` blocks while any socket is open, so a test that
    leaks a socket fails here instead of passing silently."""
    ctx = zmq.asyncio.Context()
    yield ctx
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(5.0), "zmq context did not terminate: a socket was left open"


@pytest.fixture
def endpoint_factory(tmp_path: Path) -> Iterator[object]:
    system_id = new_system_id()
    ipc_dir = IpcDirectory(system_id)
    ipc_dir.create()

    def make(transport: str, name: str = "server") -> str:
        return endpoint_for(name, transport, system_id)  # type: ignore[arg-type]

    yield make
    ipc_dir.remove()
    assert not ipc_dir.path.exists()


async def echo_server(server: ServerChannel, received: list[Envelope] | None = None) -> None:
    """Answer every call with its own payload; record envelopes."""
    while True:
        incoming = await server.recv()
        if received is not None:
            received.append(incoming.envelope)
        if incoming.envelope.is_call:
            server.reply(incoming.peer, incoming.envelope.request_id, incoming.payload)


@pytest.fixture
async def pair(
    request: pytest.FixtureRequest, context: zmq.asyncio.Context, endpoint_factory: object
) -> AsyncIterator[tuple[ServerChannel, ClientChannel]]:
    transport = request.param
    server = ServerChannel(endpoint_factory(transport), context=context)  # type: ignore[operator]
    client = ClientChannel(server.address, sender="tester", context=context)
    try:
        yield server, client
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("pair", TRANSPORTS, indirect=True)
async def test_request_reply(pair: tuple[ServerChannel, ClientChannel]) -> None:
    server, client = pair
    received: list[Envelope] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(echo_server, server, received)
        for i in range(20):
            assert await client.call(b"payload-%d" % i, timeout=5) == b"payload-%d" % i
        tg.cancel_scope.cancel()
    assert [e.kind for e in received] == [KIND_CALL] * 20
    assert {e.sender for e in received} == {"tester"}
    assert len({e.request_id for e in received}) == 20


@pytest.mark.parametrize("pair", TRANSPORTS, indirect=True)
async def test_fire_and_forget_arrives_in_order(pair: tuple[ServerChannel, ClientChannel]) -> None:
    server, client = pair
    for i in range(300):
        await client.send(b"%d" % i, timeout=5)
    payloads = []
    with anyio.fail_after(5):
        for _ in range(300):
            incoming = await server.recv()
            assert incoming.envelope.kind == KIND_SEND
            payloads.append(int(incoming.payload))
    assert payloads == list(range(300))


@pytest.mark.parametrize("pair", TRANSPORTS, indirect=True)
async def test_correlation_under_many_concurrent_calls(
    pair: tuple[ServerChannel, ClientChannel],
) -> None:
    """Replies come back in random order, some after a delay; each caller gets its own."""
    server, client = pair
    rng = random.Random(7)
    results: dict[int, bytes] = {}

    async def delayed_echo() -> None:
        async with anyio.create_task_group() as replies:
            while True:
                incoming = await server.recv()

                async def answer(peer: bytes, rid: int, payload: bytes, delay: float) -> None:
                    await anyio.sleep(delay)
                    server.reply(peer, rid, payload)

                delay = rng.choice([0.0, 0.0, 0.001, 0.01])
                replies.start_soon(
                    answer, incoming.peer, incoming.envelope.request_id, incoming.payload, delay
                )

    async def caller(i: int) -> None:
        results[i] = await client.call(b"call-%d" % i, timeout=10)

    async with anyio.create_task_group() as tg:
        tg.start_soon(delayed_echo)
        async with anyio.create_task_group() as callers:
            for i in range(400):
                callers.start_soon(caller, i)
        tg.cancel_scope.cancel()
    assert results == {i: b"call-%d" % i for i in range(400)}
    assert client.late_replies == 0


@pytest.mark.parametrize("pair", TRANSPORTS, indirect=True)
async def test_replies_in_reverse_order(pair: tuple[ServerChannel, ClientChannel]) -> None:
    server, client = pair
    results: dict[int, bytes] = {}

    async def reverse_server() -> None:
        batch = [await server.recv() for _ in range(50)]
        for incoming in reversed(batch):
            server.reply(incoming.peer, incoming.envelope.request_id, incoming.payload + b"!")

    async def caller(i: int) -> None:
        results[i] = await client.call(b"%d" % i, timeout=5)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reverse_server)
        for i in range(50):
            tg.start_soon(caller, i)
    assert results == {i: b"%d!" % i for i in range(50)}


@pytest.mark.parametrize("pair", TRANSPORTS, indirect=True)
async def test_timeout_then_late_reply_is_dropped(
    pair: tuple[ServerChannel, ClientChannel],
) -> None:
    server, client = pair
    started = anyio.current_time()
    with pytest.raises(TimeoutError):
        await client.call(b"slow", timeout=0.2)
    assert anyio.current_time() - started < 1.0
    # The server answers late; the next call must still get its own reply, not the stale one.
    stale = await server.recv()
    server.reply(stale.peer, stale.envelope.request_id, b"stale")
    async with anyio.create_task_group() as tg:
        tg.start_soon(echo_server, server)
        assert await client.call(b"fresh", timeout=5) == b"fresh"
        tg.cancel_scope.cancel()
    assert client.late_replies == 1


@pytest.mark.parametrize("pair", TRANSPORTS, indirect=True)
async def test_close_wakes_waiters(pair: tuple[ServerChannel, ClientChannel]) -> None:
    server, client = pair
    outcomes: list[str] = []

    async def caller() -> None:
        try:
            await client.call(b"never answered", timeout=30)
        except ChannelClosed:
            outcomes.append("closed")

    async def receiver() -> None:
        try:
            while True:  # consume the calls without answering, then block
                await server.recv()
        except ChannelClosed:
            outcomes.append("server closed")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            for _ in range(4):
                tg.start_soon(caller)
            await anyio.sleep(0.2)
            client.close()
            server.close()
    assert sorted(outcomes) == ["closed"] * 4 + ["server closed"]
    with pytest.raises(ChannelClosed):
        await client.call(b"x", timeout=1)
    with pytest.raises(ChannelClosed):
        await client.send(b"x", timeout=1)
    assert server.reply(b"peer", 1, b"x") is False


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_malformed_frames_are_skipped(
    transport: str, context: zmq.asyncio.Context, endpoint_factory: object
) -> None:
    server = ServerChannel(endpoint_factory(transport), context=context)  # type: ignore[operator]
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    client = ClientChannel(server.address, context=context)
    try:
        await raw.send_multipart([b"only one frame"])
        await raw.send_multipart([b"\xc1not an envelope", b"payload"])
        await raw.send_multipart([encode_envelope(Envelope(kind=99)), b"payload"])
        await raw.send_multipart([b"a", b"b", b"c"])
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo_server, server)
            assert await client.call(b"still serving", timeout=5) == b"still serving"
            tg.cancel_scope.cancel()
        assert server.malformed_frames == 4
    finally:
        raw.close(linger=0)
        client.close()
        server.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_oversize_frames_are_refused_by_the_socket(
    transport: str, context: zmq.asyncio.Context, endpoint_factory: object
) -> None:
    server = ServerChannel(
        endpoint_factory(transport),  # type: ignore[operator]
        context=context,
        max_message_bytes=1000,
    )
    hostile = ClientChannel(server.address, context=context)
    polite = ClientChannel(server.address, context=context)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo_server, server)
            with pytest.raises(TimeoutError):
                await hostile.call(b"x" * 5000, timeout=0.3)
            assert await polite.call(b"y" * 900, timeout=5) == b"y" * 900
            tg.cancel_scope.cancel()
    finally:
        hostile.close()
        polite.close()
        server.close()


def test_endpoints_and_ipc_directory(tmp_path: Path) -> None:
    system_id = new_system_id()
    assert endpoint_for("radix", "inproc", system_id) == f"inproc://kvactor-{system_id}/radix"
    long_name = "an-actor-name-that-is-much-too-long-for-a-unix-socket-path" * 3
    ipc = endpoint_for(long_name, "ipc", system_id)
    path = ipc_path_of(ipc)
    assert path is not None and len(str(path)) <= 103
    assert endpoint_for(long_name + "x", "ipc", system_id) != ipc
    tcp = endpoint_for("a", "tcp", system_id)
    assert tcp.startswith("tcp://127.0.0.1:") and int(tcp.rsplit(":", 1)[1]) > 0
    assert [transport_of(e) for e in (ipc, tcp)] == ["ipc", "tcp"]
    with pytest.raises(ValueError):
        endpoint_for("a", "udp", system_id)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        endpoint_for("a", "ipc", "../escape")
    with IpcDirectory(system_id) as directory:
        assert directory.path.is_dir()
        (directory.path / "leftover.sock").write_text("")
    assert not directory.path.exists()
