"""The Python client SDK for the engine's ZeroMQ endpoint (asyncio / anyio).

    async with KvactorClient("tcp://127.0.0.1:5557") as client:
        async for chunk in client.stream(prompt="Hello", params=GenerationParams(max_tokens=8)):
            print(chunk.text, end="")
        result = await client.complete(prompt="Hi", params=GenerationParams(temperature=0))
        await client.abort(request_id)

One DEALER socket carries every request of the client; a reader task hands each frame to
the stream of its `request_id`. Leaving a `stream` before its last chunk aborts the request.
The frames are documented in `transport.messages.client`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from types import TracebackType

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from transport.codec import Codec, DecodeFailure
from transport.messages.client import (
    MAX_CLIENT_FRAME_BYTES,
    ClientAbort,
    ClientChunk,
    ClientError,
    ClientReplyFrame,
    ClientSession,
    ClientSessionInfo,
    ClientSubmit,
    ClientUsage,
)
from transport.messages.engine import ChatMessage, GenerationParams, TokenLogprob

DEFAULT_FRAME_TIMEOUT_S = 600.0  # longest wait to send a frame, or for a request's next one
HEARTBEAT_IVL_MS = 1000  # ZeroMQ heartbeats of the connection (both ends send them)
HEARTBEAT_TIMEOUT_MS = 5000


class KvactorError(Exception):
    """The engine refused or ended a request (`ClientError`), or the connection failed."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: ClientUsage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


Frame = ClientChunk | ClientError | ClientSessionInfo


class KvactorClient:
    """An async client of one engine endpoint. Use as `async with KvactorClient(addr) as c`."""

    def __init__(
        self,
        address: str,
        *,
        context: zmq.asyncio.Context | None = None,
        frame_timeout_s: float | None = DEFAULT_FRAME_TIMEOUT_S,
        api_key: str | None = None,
        server_key: str | bytes | None = None,
    ) -> None:
        self.address = address
        self.api_key = api_key
        # The server's CURVE public key (Z85, its `zmq_server.pub`) when it runs with one.
        self.server_key = server_key.encode() if isinstance(server_key, str) else server_key
        self.frame_timeout_s = frame_timeout_s
        self._context = context or zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._task_group: TaskGroup | None = None
        self._streams: dict[str, MemoryObjectSendStream[Frame]] = {}
        self._codec: Codec = Codec(ClientReplyFrame, max_message_bytes=64 * 1024 * 1024)
        self._request_codec: Codec = Codec(
            ClientSubmit | ClientAbort | ClientSession, max_message_bytes=MAX_CLIENT_FRAME_BYTES
        )
        self._prefix = secrets.token_hex(4)
        self._ids = itertools.count(1)
        self.errors: list[ClientError] = []  # errors that named no request (malformed frames)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> KvactorClient:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Heartbeats both ways: a dead server (or a dead client, seen by the server) is
        # noticed within seconds, not at the TCP timeout.
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if self.server_key is not None:
            public, secret = zmq.curve_keypair()  # this client's own, for this connection
            sock.curve_serverkey = self.server_key.strip()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(self.address)
        self._socket = sock
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        task_group.start_soon(self._read)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
        self._close_streams()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _read(self) -> None:
        assert self._socket is not None
        try:
            while True:
                frames = await self._socket.recv_multipart()
                frame = self._codec.decode(frames[-1]) if len(frames) == 1 else None
                if frame is None or isinstance(frame, DecodeFailure):
                    continue  # not a frame of this protocol: nothing can be routed
                target = self._streams.get(frame.request_id) if frame.request_id else None
                if target is None:
                    if isinstance(frame, ClientError):
                        self.errors.append(frame)
                    continue
                with contextlib.suppress(anyio.BrokenResourceError):
                    target.send_nowait(frame)
        finally:
            self._close_streams()

    def _close_streams(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    # ---- requests ----------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def stream(
        self,
        *,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[ChatMessage] | None = None,
        params: GenerationParams | None = None,
        request_id: str | None = None,
        session_id: str = "",
    ) -> AsyncGenerator[ClientChunk, None]:
        """An async generator of the request's chunks, ending with the one that has a
        `finish_reason`. Raises `KvactorError` when the engine refuses the request.

        Closing the generator before its end aborts the request: do it at once with
        `async with contextlib.aclosing(client.stream(...)) as chunks:`; a generator
        merely dropped is closed (and the request aborted) when it is garbage collected.
        """
        submit = ClientSubmit(
            request_id=request_id or self.new_request_id(),
            params=params or GenerationParams(),
            prompt=prompt,
            prompt_ids=prompt_ids,
            messages=messages,
            stream=True,
            api_key=self.api_key,
            session_id=session_id,
        )
        return self._run(submit)

    async def complete(
        self,
        *,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[ChatMessage] | None = None,
        params: GenerationParams | None = None,
        request_id: str | None = None,
        session_id: str = "",
    ) -> Completion:
        """The whole generation in one frame (the engine accumulates it)."""
        submit = ClientSubmit(
            request_id=request_id or self.new_request_id(),
            params=params or GenerationParams(),
            prompt=prompt,
            prompt_ids=prompt_ids,
            messages=messages,
            stream=False,
            api_key=self.api_key,
            session_id=session_id,
        )
        async with contextlib.aclosing(self._run(submit)) as frames:
            async for frame in frames:
                if frame.finish_reason is not None:
                    return Completion(
                        request_id=frame.request_id,
                        text=frame.text,
                        token_ids=list(frame.token_ids),
                        finish_reason=frame.finish_reason,
                        usage=frame.usage,
                        logprobs=list(frame.logprobs),
                    )
        raise KvactorError("connection_closed", "no final frame", submit.request_id)

    # ---- streaming sessions --------------------------------------------------------------

    async def open_session(
        self, ttl_s: float = 0.0, max_tokens: int = 0, priority: int = 0, retain_s: float = 0.0
    ) -> ClientSessionInfo:
        """A new streaming session: pass its `session_id` to `stream`/`complete` with the
        whole conversation each turn. `ttl_s`: idle timeout (0: the server's default);
        `max_tokens`: the conversation's capacity (0: the context length); `priority`: a
        higher one keeps its KV in the server's pool and tiers longer; `retain_s` (at most
        `ttl_s`): its KV stays in the tiers this long after each turn unless nothing else
        is left to drop."""
        return await self._session(
            "open", ttl_s=ttl_s, max_tokens=max_tokens, priority=priority, retain_s=retain_s
        )

    async def get_session(self, session_id: str) -> ClientSessionInfo:
        return await self._session("get", session_id=session_id)

    async def close_session(self, session_id: str) -> ClientSessionInfo:
        """Close it; its KV is released (when a turn runs, at the end of that turn)."""
        return await self._session("close", session_id=session_id)

    async def offload_session(self, session_id: str) -> ClientSessionInfo:
        """Move its KV out of the server's pool now (to the host tier, when the server has
        one), e.g. before a long tool call; its next turn loads it back."""
        return await self._session("offload", session_id=session_id)

    async def prefetch_session(self, session_id: str) -> ClientSessionInfo:
        """Load its KV from the server's tier back into its pool now, e.g. as a tool call
        returns; `pool_tokens` in the reply says what the pool holds."""
        return await self._session("prefetch", session_id=session_id)

    async def _session(self, op: str, **fields) -> ClientSessionInfo:
        if self._socket is None:
            raise RuntimeError("KvactorClient is not open; use `async with`")
        rid = self.new_request_id()
        send, recv = anyio.create_memory_object_stream[Frame](math.inf)
        self._streams[rid] = send
        try:
            async with recv:
                with anyio.fail_after(self.frame_timeout_s):
                    await self._send(
                        ClientSession(request_id=rid, op=op, api_key=self.api_key, **fields)
                    )
                    try:
                        frame = await recv.receive()
                    except anyio.EndOfStream:
                        raise KvactorError("connection_closed", "no reply", rid) from None
        finally:
            self._streams.pop(rid, None)
            send.close()
        if isinstance(frame, ClientError):
            raise KvactorError(frame.code, frame.message, rid)
        if not isinstance(frame, ClientSessionInfo):
            raise KvactorError("protocol", f"unexpected {type(frame).__name__}", rid)
        return frame

    async def abort(self, request_id: str) -> None:
        """Ask the engine to end `request_id`; its stream then ends with finish "abort"."""
        await self._send(ClientAbort(request_id=request_id, api_key=self.api_key))

    async def _run(self, submit: ClientSubmit) -> AsyncGenerator[ClientChunk, None]:
        rid = submit.request_id
        if self._socket is None:
            raise RuntimeError("KvactorClient is not open; use `async with`")
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        send, recv = anyio.create_memory_object_stream[Frame](math.inf)
        self._streams[rid] = send
        finished = False
        try:
            # The send waits too (a DEALER with no live peer has no pipe to write to).
            with anyio.fail_after(self.frame_timeout_s):
                await self._send(submit)
            async with recv:
                while True:
                    with anyio.fail_after(self.frame_timeout_s):
                        try:
                            frame = await recv.receive()
                        except anyio.EndOfStream:
                            raise KvactorError(
                                "connection_closed",
                                "the client closed before the request ended",
                                rid,
                            ) from None
                    if isinstance(frame, ClientError):
                        finished = True
                        raise KvactorError(frame.code, frame.message, rid)
                    finished = frame.finish_reason is not None
                    yield frame
                    if finished:
                        return
        finally:
            self._streams.pop(rid, None)
            send.close()
            if not finished and self._socket is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await self._send(ClientAbort(request_id=rid, api_key=self.api_key))

    async def _send(self, frame: ClientSubmit | ClientAbort | ClientSession) -> None:
        if self._socket is None:
            raise RuntimeError("KvactorClient is not open; use `async with`")
        await self._socket.send(self._request_codec.encode(frame))
