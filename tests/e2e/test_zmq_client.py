"""The ZeroMQ client SDK and endpoint against a real server process.

The SDK streams a greedy generation whose text equals the HTTP gateway's for the same
prompt; `complete` gathers the same; an abort mid-stream ends the stream with "abort" and
frees the KV; malformed frames from a raw DEALER get `ClientError` frames and the
endpoint keeps serving.
"""

from __future__ import annotations

import contextlib

import anyio
import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from tests.e2e.server_fixtures import (
    MODEL_NAME,
    scrape_metrics,
    wait_idle,
)
from transport.client import KvactorClient, KvactorError
from transport.codec import Codec
from transport.messages.client import (
    ERR_DUPLICATE_ID,
    ERR_INVALID_REQUEST,
    ERR_MALFORMED,
    ERR_UNAUTHORIZED,
    ClientChunk,
    ClientError,
    ClientReplyFrame,
    ClientSubmit,
)
from transport.messages.engine import ChatMessage, GenerationParams

pytestmark = [pytest.mark.model]

PROMPT = "Count: 1, 2, 3, 4, 5,"
GREEDY = GenerationParams(max_tokens=8, temperature=0.0)


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    wait_idle(server)


def http_text(server, **body) -> dict:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.auth,
        timeout=60,
        json={"model": MODEL_NAME, **body},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_stream_matches_http_and_complete(server):
    expected = http_text(server, prompt=PROMPT, max_tokens=8, temperature=0)

    async def run() -> None:
        async with KvactorClient(server.zmq_address, api_key=server.api_key) as client:
            chunks = [
                c async for c in client.stream(prompt=PROMPT, params=GREEDY, request_id="greedy-1")
            ]
            whole = await client.complete(prompt=PROMPT, params=GREEDY)
            chat = await client.complete(
                messages=[ChatMessage(role="user", content="Hi")],
                params=GenerationParams(max_tokens=3, temperature=0.0),
            )
        assert all(c.request_id == "greedy-1" for c in chunks)
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        last = chunks[-1]
        assert last.finish_reason == "length"
        text = "".join(c.text for c in chunks)
        assert text == expected["choices"][0]["text"]
        assert sum(len(c.token_ids) for c in chunks) == 8
        assert last.usage.completion_tokens == 8
        assert last.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
        assert whole.text == text and whole.finish_reason == "length"
        assert len(whole.token_ids) == 8 and whole.usage.completion_tokens == 8
        assert chat.finish_reason == "length" and len(chat.token_ids) == 3

    anyio.run(run)


def test_abort_mid_stream_and_leave_early(server):
    long = GenerationParams(max_tokens=400, ignore_eos=True, temperature=0.0)
    aborted_before = scrape_metrics(server)["kvactor:kv_aborted_total"]

    async def run() -> None:
        async with KvactorClient(server.zmq_address, api_key=server.api_key) as client:
            seen = []
            async for chunk in client.stream(
                prompt="Tell me a story.", params=long, request_id="to-abort"
            ):
                seen.append(chunk)
                if len(seen) == 3:
                    await client.abort("to-abort")
            assert seen[-1].finish_reason == "abort"
            assert len(seen) < 50
            assert all(c.finish_reason is None for c in seen[:-1])
            # Leaving a stream early (closing its generator) aborts its request too.
            async with contextlib.aclosing(
                client.stream(prompt="Another story.", params=long)
            ) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids:
                        break
            # The client still works after both.
            done = await client.complete(prompt=PROMPT, params=GREEDY)
            assert done.finish_reason == "length"

    anyio.run(run)
    wait_idle(server, timeout_s=10)
    assert scrape_metrics(server)["kvactor:kv_aborted_total"] >= aborted_before + 2


def test_refusals_arrive_as_errors(server):
    async def run() -> None:
        async with KvactorClient(server.zmq_address, api_key=server.api_key) as client:
            with pytest.raises(KvactorError) as info:
                async for _ in client.stream(prompt="x", params=GenerationParams(temperature=5)):
                    pass
            assert info.value.code == ERR_INVALID_REQUEST and "temperature" in info.value.message
            with pytest.raises(KvactorError) as info:
                await client.complete(prompt="", params=GREEDY)
            assert info.value.code == ERR_INVALID_REQUEST

    anyio.run(run)


def test_malformed_frames_get_client_errors(server):
    codec: Codec = Codec(ClientReplyFrame)

    async def run() -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.zmq_address)
        key = server.api_key
        try:

            async def reply() -> ClientChunk | ClientError:
                with anyio.fail_after(30):
                    frames = await sock.recv_multipart()
                assert len(frames) == 1
                decoded = codec.decode(frames[0])
                assert isinstance(decoded, (ClientChunk, ClientError)), decoded
                return decoded

            hostile = [
                [b"not msgpack \xc1"],
                [b""],
                [msgspec.msgpack.encode({"type": "ClientLaunchMissiles", "request_id": "x"})],
                [msgspec.msgpack.encode({"type": "ClientSubmit"})],  # no request_id
                [
                    msgspec.msgpack.encode(
                        {
                            "type": "ClientSubmit",
                            "request_id": "a",
                            "params": {"max_tokens": "many"},
                        }
                    )
                ],
                [
                    msgspec.msgpack.encode(
                        {"type": "ClientSubmit", "request_id": "a", "prompt": "x", "surprise": 1}
                    )
                ],
                [msgspec.msgpack.encode([1, 2, 3])],
                [
                    msgspec.msgpack.encode(
                        {"type": "ClientSubmit", "request_id": "", "prompt": "x", "api_key": key}
                    )
                ],
                [b"two", b"frames"],
            ]
            for frames in hostile:
                await sock.send_multipart(frames)
                error = await reply()
                assert isinstance(error, ClientError), (frames, error)
                assert error.code == ERR_MALFORMED and error.message
            # A valid frame on the same socket works, and a duplicate live id is refused.
            submit = ClientSubmit(
                request_id="ok-1",
                api_key=server.api_key,
                prompt=PROMPT,
                params=GenerationParams(max_tokens=30, temperature=0.0, ignore_eos=True),
            )
            await sock.send(msgspec.msgpack.encode(submit))
            await sock.send(msgspec.msgpack.encode(submit))
            frames = [await reply()]
            while not (isinstance(frames[-1], ClientChunk) and frames[-1].finish_reason):
                frames.append(await reply())
            dup = [f for f in frames if isinstance(f, ClientError)]
            assert len(dup) == 1 and dup[0].code == ERR_DUPLICATE_ID
            assert dup[0].request_id == "ok-1"
            chunks = [f for f in frames if isinstance(f, ClientChunk)]
            assert chunks[-1].finish_reason == "length"
            assert sum(len(c.token_ids) for c in chunks) == 30
        finally:
            sock.close(linger=0)

    anyio.run(run)
    # The endpoint survived every frame (the autouse fixture also checks the engine is idle).
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200


def test_disconnected_client_has_its_requests_aborted(server):
    """A DEALER that vanishes mid-stream: the next chunk to it fails, the request aborts."""
    aborted_before = scrape_metrics(server)["kvactor:kv_aborted_total"]

    async def run() -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.zmq_address)
        submit = ClientSubmit(
            request_id="vanish",
            api_key=server.api_key,
            prompt="Tell me everything.",
            params=GenerationParams(max_tokens=400, ignore_eos=True, temperature=0.0),
        )
        await sock.send(msgspec.msgpack.encode(submit))
        with anyio.fail_after(30):
            await sock.recv_multipart()
        sock.close(linger=0)

    anyio.run(run)
    wait_idle(server, timeout_s=10)
    assert scrape_metrics(server)["kvactor:kv_aborted_total"] >= aborted_before + 1


def test_the_api_key_is_required(server):
    """With --api-key, a frame without it (or with a wrong one) is refused with
    "unauthorized" and never reaches the engine."""
    submitted = scrape_metrics(server)["kvactor:scheduler_prompt_tokens_total"]

    async def run() -> None:
        for key in (None, "wrong-key", server.api_key.upper()):
            async with KvactorClient(server.zmq_address, api_key=key) as client:
                with pytest.raises(KvactorError) as err:
                    await client.complete(prompt=PROMPT, params=GREEDY)
                assert err.value.code == ERR_UNAUTHORIZED

    anyio.run(run)
    assert scrape_metrics(server)["kvactor:scheduler_prompt_tokens_total"] == submitted


def _raw_submit(server, rid: str, stream: bool, max_tokens: int = 1000) -> bytes:
    return msgspec.msgpack.encode(
        ClientSubmit(
            request_id=rid,
            api_key=server.api_key,
            prompt="Write a very long story.",
            stream=stream,
            params=GenerationParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        )
    )


def test_a_departed_clients_requests_end_and_its_routing_id_inherits_nothing(server):
    """A client that leaves with a non-streaming and a streaming request in flight: both
    are aborted at once (not run to their 1000 tokens), and a new socket that connects
    with the same routing id receives none of their output."""
    aborted_before = scrape_metrics(server)["kvactor:kv_aborted_total"]

    async def run() -> list[bytes]:
        ctx = zmq.asyncio.Context.instance()
        first = ctx.socket(zmq.DEALER)
        first.setsockopt(zmq.LINGER, 0)
        first.setsockopt(zmq.ROUTING_ID, b"shared-identity")
        first.connect(server.zmq_address)
        await first.send(_raw_submit(server, "whole", stream=False))
        await first.send(_raw_submit(server, "streamed", stream=True))
        with anyio.fail_after(30):
            await first.recv_multipart()  # the stream's first chunk: both are running
        first.close(linger=0)
        second = ctx.socket(zmq.DEALER)
        second.setsockopt(zmq.LINGER, 0)
        second.setsockopt(zmq.ROUTING_ID, b"shared-identity")
        second.connect(server.zmq_address)
        got: list[bytes] = []
        with anyio.move_on_after(3):
            while True:
                got.append((await second.recv_multipart())[0])
        second.close(linger=0)
        return got

    got = anyio.run(run)
    assert got == []
    wait_idle(server, timeout_s=5)  # 1000 tokens each would take far longer
    assert scrape_metrics(server)["kvactor:kv_aborted_total"] >= aborted_before + 2


FROZEN_CLIENT = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
sock.connect(sys.argv[1])
sock.send(bytes.fromhex(sys.argv[2]))
print("sent", flush=True)
time.sleep(600)
"""


def test_a_frozen_client_is_found_by_heartbeats_and_its_request_aborted(server):
    """A client process that stops (SIGSTOP) with a non-streaming request in flight keeps
    its TCP connection open; the endpoint's heartbeats find it gone and abort the request."""
    import os
    import signal
    import subprocess
    import sys
    import time

    aborted_before = scrape_metrics(server)["kvactor:kv_aborted_total"]
    frame = _raw_submit(server, "frozen", stream=False).hex()
    proc = subprocess.Popen(
        [sys.executable, "-c", FROZEN_CLIENT, server.zmq_address, frame],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "sent"
        time.sleep(1.0)  # admitted and running
        os.kill(proc.pid, signal.SIGSTOP)
        wait_idle(server, timeout_s=20)  # heartbeat timeout (5 s), then the abort
        assert scrape_metrics(server)["kvactor:kv_aborted_total"] >= aborted_before + 1
    finally:
        proc.kill()
        proc.wait()
