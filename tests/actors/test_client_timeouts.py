"""The ZeroMQ SDK's `frame_timeout_s` bounds every wait on the server, including the send:
a DEALER whose only peer refused its handshake has no pipe to write to, and a send without a
deadline would then wait forever."""

from __future__ import annotations

import time

import anyio
import pytest
import zmq
import zmq.asyncio

from transport.client import KvactorClient
from transport.messages.params import GenerationParams


@pytest.fixture
def curve_server_address():
    """A CURVE server socket that never answers; a client without its key fails the handshake."""
    public, secret = zmq.curve_keypair()
    server = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    server.curve_server = True
    server.curve_publickey = public
    server.curve_secretkey = secret
    port = server.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    server.close(linger=0)


async def _after_the_handshake_failed(address: str, call) -> float:
    async with KvactorClient(address, frame_timeout_s=0.5) as client:
        await anyio.sleep(0.5)  # the handshake has failed: the socket has no pipe left
        start = time.monotonic()
        with anyio.fail_after(10), pytest.raises(TimeoutError):
            await call(client)
        return time.monotonic() - start


def test_complete_times_out_when_the_send_cannot_go_out(curve_server_address):
    async def complete(client: KvactorClient) -> None:
        await client.complete(prompt="hi", params=GenerationParams(max_tokens=2))

    waited = anyio.run(_after_the_handshake_failed, curve_server_address, complete)
    assert waited < 5


def test_stream_times_out_when_the_send_cannot_go_out(curve_server_address):
    async def stream(client: KvactorClient) -> None:
        async for _ in client.stream(prompt="hi", params=GenerationParams(max_tokens=2)):
            pass

    waited = anyio.run(_after_the_handshake_failed, curve_server_address, stream)
    assert waited < 5


def test_session_calls_time_out_when_the_send_cannot_go_out(curve_server_address):
    async def open_session(client: KvactorClient) -> None:
        await client.open_session()

    waited = anyio.run(_after_the_handshake_failed, curve_server_address, open_session)
    assert waited < 5
