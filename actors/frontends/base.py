"""What every frontend shares: one stream per request, and an abort when its reader leaves.

A frontend is an actor that submits requests to the tokenizer with itself as `reply_to`, so
its inbox is `OutputBatch`; `FrontendActor` routes each chunk to its request's stream
(`StreamRouter`). `EngineClient` is the API over it: `generate` yields a request's chunks,
`complete` gathers one result. Invariant: a request whose reader stops before its final
chunk (the generator is closed, or its task cancelled) is aborted, so its KV goes back.

The three frontends are this base (the in-process one: offline API, `bin/engine generate`),
the HTTP gateway (`actors.frontends.http`) and the ZeroMQ endpoint
(`actors.frontends.zmq_endpoint`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.runtime import Actor, ActorRef, RemoteError
from transport.messages.engine import (
    AbortGeneration,
    Accepted,
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    EndStreams,
    FinishReason,
    GenerateRequest,
    GenerationParams,
    OutputBatch,
    OutputChunk,
    StopAccepting,
    TokenizeReply,
    TokenizeRequest,
    TokenizerInfo,
    TokenizerInfoRequest,
)
from transport.messages.sessions import (
    CloseSession,
    GetSession,
    OffloadSession,
    OpenSession,
    PrefetchSession,
    SessionInfo,
)

ERR_ENGINE_STOPPED = "engine_stopped"  # the engine stopped (or its runner failed) mid-request


def engine_session_id(api_key: str, session_id: str) -> str:
    """The engine's name for the client's session `session_id` under `api_key` ("" when the
    server has no keys): HMAC-SHA256(key, id), 32 hex digits.

    Invariant (sessions bound to the key that opened them): clients only ever see their own
    ids, the engine (sessions actor, tokenizer, allocator, their logs) only these names, and
    a frontend maps one to the other with the key the request authorized with. The same id
    under another key is another name, one no session has: a 404 everywhere (HTTP and
    ZeroMQ, session calls and turns alike), with nothing to compare or race. The name does
    not reveal the id, so an engine log line holding it cannot be replayed."""
    digest = hmac.new(api_key.encode(), b"kvactor-session:" + session_id.encode(), hashlib.sha256)
    return digest.hexdigest()[:32]


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

    def fail_all(self, reason: str) -> int:
        """End every open stream with an error chunk saying `reason`; how many there were."""
        rids = list(self._streams)
        for rid in rids:
            self.deliver(
                [
                    OutputChunk(
                        client_rid=rid, text=reason, token_ids=[], finish_reason=FinishReason.ERROR
                    )
                ]
            )
        return len(rids)

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
    """Base of the frontends: `self.client` submits as this actor; chunks reach its streams.

    Subclasses that override `on_start` call `super().on_start()` first.
    """

    inbox = OutputBatch | StopAccepting | EndStreams

    def __init__(self, tokenizer: str = "tokenizer", sessions: str = "sessions") -> None:
        self.tokenizer_name = tokenizer
        self.sessions_name = sessions
        self.router = StreamRouter()
        self.client: EngineClient | None = None
        self.accepting = True  # False while the server drains: new requests are refused

    async def on_start(self) -> None:
        self.client = EngineClient(
            self.ref(self.tokenizer_name),
            self.router,
            self.name,
            sessions=self.optional_ref(self.sessions_name),
        )

    async def handle(self, msg, sender):
        if isinstance(msg, OutputBatch):
            self.router.deliver(msg.chunks)
        elif isinstance(msg, StopAccepting):
            self.accepting = False
        elif isinstance(msg, EndStreams):
            self.router.fail_all(msg.reason)
        return None

    async def on_stop(self) -> None:
        # Every client still waiting hears why its stream ends (never a silent cut).
        self.router.fail_all("the engine stopped")

    def stats(self) -> dict[str, int | float]:
        return {"open_streams": len(self.router)}


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
    prompt_logprobs: list = field(default_factory=list)  # prompt tokens 1.. when asked for


class EngineClient:
    """Submit requests to the tokenizer actor and read their outputs."""

    def __init__(
        self,
        tokenizer: ActorRef,
        router: StreamRouter,
        frontend_name: str,
        sessions: ActorRef | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.sessions = sessions
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
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        session_id: str = "",
        tools: list[dict] | None = None,
        session_key: str = "",
    ) -> AsyncIterator[OutputChunk]:
        """The chunks of one request. With `session_id` it is a turn of that streaming
        session (opened under API key `session_key`): the prompt is the whole conversation,
        the session's KV is reused."""
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
                        continue_final_message=continue_final_message,
                        chat_template_kwargs=chat_template_kwargs or {},
                        session_id=engine_session_id(session_key, session_id) if session_id else "",
                        tools=tools or [],
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
                    if chunk.finish_reason == FinishReason.ERROR:
                        # Not marked finished: when the end came from this side (a shutdown)
                        # the engine may still run it, so it is aborted (harmless otherwise).
                        raise GenerationError(ERR_ENGINE_STOPPED, chunk.text)
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

    # ---- streaming sessions ----------------------------------------------------------------
    # Sessions are owned by an API key (`key`, "" without keys): see `engine_session_id`.
    async def open_session(
        self,
        ttl_s: float = 0.0,
        max_tokens: int = 0,
        key: str = "",
        priority: int = 0,
        retain_s: float = 0.0,
    ) -> SessionInfo:
        """A new session (ttl_s: idle timeout, 0 = the server's default; max_tokens: the
        conversation's capacity, 0 = the context length; the hints `priority` and
        `retain_s`, see `OpenSession`), usable under `key` only."""
        session_id = secrets.token_hex(12)  # the client's id; the engine gets its name
        msg = OpenSession(
            ttl_s=ttl_s,
            max_tokens=max_tokens,
            session_id=engine_session_id(key, session_id),
            priority=priority,
            retain_s=retain_s,
        )
        return await self._session_call(msg, session_id)

    async def get_session(self, session_id: str, key: str = "") -> SessionInfo:
        name = engine_session_id(key, session_id)
        return await self._session_call(GetSession(session_id=name), session_id)

    async def close_session(self, session_id: str, key: str = "") -> SessionInfo:
        """Close it and release its KV (at the end of a running turn, if one runs)."""
        name = engine_session_id(key, session_id)
        return await self._session_call(CloseSession(session_id=name), session_id)

    async def offload_session(self, session_id: str, key: str = "") -> SessionInfo:
        """Move its KV out of the pool now (to the host tier, when the engine has one): the
        client knows the session will idle (a long tool call); its next turn loads it back."""
        name = engine_session_id(key, session_id)
        return await self._session_call(OffloadSession(session_id=name), session_id)

    async def prefetch_session(self, session_id: str, key: str = "") -> SessionInfo:
        """Load its KV from the tier it waits in back into the pool now: the client knows
        its next turn is coming (a tool call is about to return)."""
        name = engine_session_id(key, session_id)
        return await self._session_call(PrefetchSession(session_id=name), session_id)

    async def _session_call(self, msg, session_id: str) -> SessionInfo:
        """The sessions actor's answer to `msg`, naming the session by the client's id."""
        if self.sessions is None:
            raise GenerationError("session_not_found", "this engine runs without sessions")
        try:
            info = await self.sessions.call(msg, expect=SessionInfo)
        except RemoteError as exc:
            raise GenerationError(exc.reply.code, exc.reply.message) from None
        return msgspec.structs.replace(info, session_id=session_id)

    async def tokenize(self, **request) -> TokenizeReply:
        """Token ids of a prompt or of chat messages (TokenizeRequest's fields)."""
        try:
            return await self.tokenizer.call(TokenizeRequest(**request), expect=TokenizeReply)
        except RemoteError as exc:
            raise GenerationError(exc.reply.code, exc.reply.message) from None

    async def tokenizer_info(self) -> TokenizerInfo:
        """The served tokenizer's facts and chat template (vLLM's /tokenizer_info)."""
        try:
            return await self.tokenizer.call(TokenizerInfoRequest(), expect=TokenizerInfo)
        except RemoteError as exc:
            raise GenerationError(exc.reply.code, exc.reply.message) from None

    async def detokenize(self, tokens: list[int]) -> str:
        try:
            reply = await self.tokenizer.call(
                DetokenizeRequest(tokens=tokens), expect=DetokenizeReply
            )
        except RemoteError as exc:
            raise GenerationError(exc.reply.code, exc.reply.message) from None
        return reply.prompt

    async def complete(self, params: GenerationParams, **prompt) -> GenerationResult:
        t0 = time.perf_counter()
        ttft = None
        texts: list[str] = []
        ids: list[int] = []
        lps: list = []
        prompt_lps: list = []
        last = None
        async for chunk in self.generate(params, **prompt):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            lps.extend(chunk.logprobs)
            prompt_lps.extend(chunk.prompt_logprobs)
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
            prompt_logprobs=prompt_lps,
        )
