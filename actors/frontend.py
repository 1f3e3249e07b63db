"""The client side of the engine inside one process: a frontend actor and `EngineClient`.

The frontend actor receives `OutputBatch` messages (it is the `reply_to` of the
requests its client submits) and routes each chunk to the stream of its
request. `EngineClient` is the Python API over it: `generate` yields chunks,
`complete` gathers one result; leaving a stream early aborts the request.
The HTTP gateway and the offline API are built on it.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.runtime import Actor, ActorRef, RemoteError
from transport.messages.engine import (
    AbortGeneration,
    Accepted,
    ChatMessage,
    GenerateRequest,
    GenerationParams,
    OutputBatch,
    OutputChunk,
)


class GenerationError(Exception):
    """The engine refused a request. `code` is "invalid_request" for bad input."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamRouter:
    """client_rid -> the memory stream its chunks go to."""

    def __init__(self) -> None:
        self._streams: dict[str, MemoryObjectSendStream[OutputChunk]] = {}

    def open(self, client_rid: str) -> MemoryObjectReceiveStream[OutputChunk]:
        send, recv = anyio.create_memory_object_stream[OutputChunk](math.inf)
        self._streams[client_rid] = send
        return recv

    def close(self, client_rid: str) -> None:
        send = self._streams.pop(client_rid, None)
        if send is not None:
            send.close()

    def deliver(self, chunks: list[OutputChunk]) -> None:
        for chunk in chunks:
            send = self._streams.get(chunk.client_rid)
            if send is None:
                continue  # the client already left
            send.send_nowait(chunk)
            if chunk.finish_reason is not None:
                self.close(chunk.client_rid)

    def __len__(self) -> int:
        return len(self._streams)


class FrontendActor(Actor):
    inbox = OutputBatch

    def __init__(self, router: StreamRouter) -> None:
        self.router = router

    async def handle(self, msg, sender):
        self.router.deliver(msg.chunks)
        return None


@dataclass
class GenerationResult:
    client_rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    logprobs: list = field(default_factory=list)


class EngineClient:
    """Submit requests to the tokenizer actor and read their outputs."""

    def __init__(self, tokenizer: ActorRef, router: StreamRouter, frontend_name: str) -> None:
        self.tokenizer = tokenizer
        self.router = router
        self.frontend_name = frontend_name
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid()}-{id(self):x}"

    def new_rid(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def generate(
        self,
        params: GenerationParams,
        *,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[ChatMessage] | None = None,
        client_rid: str | None = None,
        on_accepted=None,
        add_generation_prompt: bool = True,
    ) -> AsyncIterator[OutputChunk]:
        rid = client_rid or self.new_rid()
        recv = self.router.open(rid)
        finished = False
        try:
            try:
                accepted = await self.tokenizer.call(
                    GenerateRequest(
                        client_rid=rid,
                        reply_to=self.frontend_name,
                        params=params,
                        prompt=prompt,
                        prompt_ids=prompt_ids,
                        messages=messages,
                        add_generation_prompt=add_generation_prompt,
                    ),
                    expect=Accepted,
                )
            except RemoteError as exc:
                finished = True
                raise GenerationError(exc.reply.code, exc.reply.message) from None
            if on_accepted is not None:
                on_accepted(accepted)
            async with recv:
                async for chunk in recv:
                    if chunk.finish_reason is not None:
                        finished = True
                    yield chunk
                    if finished:
                        return
        finally:
            self.router.close(rid)
            if not finished:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await self.tokenizer.send(AbortGeneration(client_rids=[rid]))

    async def complete(self, params: GenerationParams, **prompt) -> GenerationResult:
        t0 = time.perf_counter()
        ttft = None
        texts: list[str] = []
        ids: list[int] = []
        lps: list = []
        last = None
        async for chunk in self.generate(params, **prompt):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            lps.extend(chunk.logprobs)
            last = chunk
        return GenerationResult(
            client_rid=last.client_rid,
            text="".join(texts),
            token_ids=ids,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
            total_s=time.perf_counter() - t0,
            logprobs=lps,
        )
