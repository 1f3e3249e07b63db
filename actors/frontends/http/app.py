"""The gateway's ASGI application: routes, auth, body limits, and the OpenAI endpoints.

Plain ASGI 3 (no framework). `GatewayApp` is given the engine-facing `EngineClient` and two
probes (actor health, engine stats) by its owner, the gateway actor, so it holds no actor
state itself. Order of checks for every request: route (404), method (405), API key on
/v1/* (401), body size while reading (413), strict decode (400), model name (404), then the
engine's own validation (400). A refused request never reaches the scheduler.

One generation request runs one `EngineClient.generate` per choice, each in its own task
feeding a single event stream, plus a task watching `receive()` for `http.disconnect`.
Invariant: when the client leaves, the task group is cancelled, which closes every
choice's generator, which sends `AbortGeneration`; its KV goes back to the pool.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.metadata
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.frontends.base import EngineClient, GenerationError
from actors.frontends.http.errors import (
    NOT_FOUND,
    SERVER_ERROR,
    UNAVAILABLE,
    ApiError,
    ErrorBody,
    from_decode_error,
    from_generation_error,
    too_deep,
)
from actors.frontends.http.generation import (
    ChatRenderer,
    ChoiceState,
    CompletionRenderer,
    Job,
    Renderer,
    chat_jobs,
    chat_message,
    check_model,
    clip,
    completion_jobs,
    usage_of,
)
from actors.frontends.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from actors.frontends.http.metrics import GatewayMetrics
from actors.frontends.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    SessionCreate,
    SessionObject,
    TokenizeRequest,
    TokenizeResponse,
)
from actors.frontends.http.sse import DONE_EVENT, SSE_HEADERS, sse_event
from actors.runtime.logging import get_logger
from transport.channel import ChannelClosed
from transport.messages.alloc import KvStats
from transport.messages.engine import OutputChunk, SchedulerStats

MAX_BODY_BYTES = 2 * 1024 * 1024
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this
SSE_KEEPALIVE_S = 5.0  # a streamed response with no event this long gets a comment line
KEEPALIVE_EVENT = b": keep-alive\n\n"
try:
    KVACTOR_VERSION = importlib.metadata.version("kvactor")
except importlib.metadata.PackageNotFoundError:  # running from a plain checkout
    KVACTOR_VERSION = "0.1.0"
_log = get_logger("gateway")
# An oversized body is read and dropped up to this size so the client can read its 413;
# beyond it the connection is closed after the 413 is sent.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024

HealthProbe = Callable[[], Awaitable[dict[str, str | None]]]  # actor -> None (up) or why down
StatsProbe = Callable[[], Awaitable[tuple[SchedulerStats | None, KvStats | None]]]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_json = msgspec.json.Encoder()
_JSON_HEADERS = [(b"content-type", b"application/json")]


class ClientGone(Exception):
    """The client disconnected before its request was read; nothing to answer."""


async def send_response(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON_HEADERS
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- one generation request ------------------------------------------------------------------

_ACCEPTED, _CHUNK, _ERROR = 0, 1, 2


@dataclass(slots=True)
class _Event:
    index: int
    kind: int
    chunk: OutputChunk | None = None
    error: ApiError | None = None


@dataclass(slots=True)
class _Outcome:
    completed: bool = False  # the last byte of the response is being sent
    succeeded: bool = False  # ... and every choice finished
    disconnected: bool = False  # the client left before `completed`
    error: ApiError | None = None  # refused before the response started


def _post(tx: MemoryObjectSendStream[_Event], event: _Event) -> None:
    # The reader may be gone (the request ended early); its events are no longer needed.
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        tx.send_nowait(event)


class GatewayApp:
    """`await app(scope, receive, send)`; see the module docstring for the order of checks."""

    def __init__(
        self,
        *,
        client: EngineClient,
        model_names: list[str],
        context_len: int,
        api_key: str | list[str] | None,
        health: HealthProbe,
        stats: StatsProbe,
        metrics: GatewayMetrics | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        generation_defaults: dict[str, Any] | None = None,
        allowed_origins: list[str] | None = None,
        keepalive_s: float = SSE_KEEPALIVE_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        accepting: Callable[[], bool] = lambda: True,
    ) -> None:
        if not model_names:
            raise ValueError("the gateway needs at least one model name")
        self.client = client
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        self.context_len = context_len
        self.generation_defaults = dict(generation_defaults or {})
        self.allowed_origins = set(allowed_origins or ())
        self.keepalive_s = keepalive_s
        self._warned_fields: set[str] = set()
        # Any of these keys opens /v1/* (vLLM's --api-key takes several); none: no auth.
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self._api_keys = [k.encode() for k in keys if k]
        self.health = health
        self.stats = stats
        self.metrics = metrics or GatewayMetrics(self.model_name, context_len)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.accepting = accepting
        self.created = int(time.time())
        self.routes: dict[str, dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]]] = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat_completions},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/version": {"GET": self._version},
            "/v1/sessions": {"POST": self._open_session},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        request_id = _request_id(scope)
        scope["kvactor.request_id"] = request_id
        extra = [(b"x-request-id", request_id.encode()), *self._cors_headers(scope)]
        head_only = scope["method"] == "HEAD"

        raw_send = send

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif head_only and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await raw_send(message)

        send = send_with_headers
        try:
            await self._dispatch(scope, receive, send)
        except ApiError as err:
            self.metrics.count_error(err.status)
            await send_response(send, err.status, err.body(), [*_JSON_HEADERS, *err.headers])
        except ClientGone:
            self.metrics.count_aborted()

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        methods = self.routes.get(path)
        if methods is None and path.startswith("/v1/models/"):
            methods = {"GET": self._model}
        if methods is None and path.startswith("/v1/sessions/"):
            methods = {"GET": self._get_session, "DELETE": self._close_session}
        if methods is None:
            raise ApiError(404, f"no route {clip(path)}", type=NOT_FOUND, code="not_found")
        method = scope["method"]
        if method == "OPTIONS":
            await self._options(scope, send, methods)
            return
        handler = methods.get("GET" if method == "HEAD" else method)
        if handler is None:
            raise ApiError(
                405,
                f"method {scope['method']} is not allowed on {path}",
                code="method_not_allowed",
                headers=[(b"allow", ", ".join(methods).encode())],
            )
        if path.startswith("/v1/"):
            # The key a request authorized with owns the sessions it opens (below).
            scope["kvactor.api_key"] = self._authorize(scope)
        if method == "POST" and path in _GENERATION_PATHS and not self.accepting():
            raise ApiError(
                503,
                "the server is shutting down and takes no new requests; retry elsewhere",
                type=UNAVAILABLE,
                code="shutting_down",
                headers=[(b"connection", b"close"), (b"retry-after", b"1")],
            )
        await handler(scope, receive, send)

    def _cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        origin = _header(scope, b"origin")
        if origin is None or not self.allowed_origins:
            return []
        if "*" in self.allowed_origins:
            allow = b"*"
        elif origin.decode("latin-1") in self.allowed_origins:
            allow = origin
        else:
            return []
        return [
            (b"access-control-allow-origin", allow),
            (b"vary", b"Origin"),
            (b"access-control-expose-headers", b"x-request-id"),
        ]

    async def _options(self, scope: Scope, send: Send, methods: dict) -> None:
        """A CORS preflight (or a plain OPTIONS): the allowed methods, no body."""
        allowed = ", ".join([*methods, *(["HEAD"] if "GET" in methods else []), "OPTIONS"])
        headers = [(b"allow", allowed.encode())]
        if self._cors_headers(scope):
            wanted = _header(scope, b"access-control-request-headers") or b"*"
            headers += [
                (b"access-control-allow-methods", allowed.encode()),
                (b"access-control-allow-headers", wanted),
                (b"access-control-max-age", b"600"),
            ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _authorize(self, scope: Scope) -> str:
        """The configured key the request carries ("" when no keys are configured); 401
        without one."""
        if not self._api_keys:
            return ""
        given = _header(scope, b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if given is None:
            raise ApiError(
                401,
                "Missing API key: send `Authorization: Bearer <key>`.",
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
            )
        # RFC 7235: the scheme is case-insensitive ("bearer", "BEARER" work too). Every key is
        # compared (in constant time each), so the time taken says nothing about which.
        token = token.strip()
        matched = [k for k in self._api_keys if hmac.compare_digest(token, k)]
        if scheme.lower() != b"bearer" or not matched:
            raise ApiError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
            )
        return matched[0].decode()

    # ---- bodies ------------------------------------------------------------------------------

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body, refused with 413 as soon as it exceeds the cap, and with 408 (then
        a close) when it is not complete within `body_timeout_s` (a slow or short body)."""
        try:
            with anyio.fail_after(self.body_timeout_s):
                return await self._read_body_unbounded(scope, receive)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body was not received within {self.body_timeout_s:g} s",
                code="request_timeout",
                headers=[(b"connection", b"close")],
            ) from None

    async def _read_body_unbounded(self, scope: Scope, receive: Receive) -> bytes:
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "invalid Content-Length header", code="invalid_header")
            if int(declared) > self.max_body_bytes:
                # A client waiting for `100 Continue` has sent nothing: refuse, then close.
                waits = _header(scope, b"expect") == b"100-continue"
                drained = (
                    not waits and int(declared) <= DRAIN_LIMIT_BYTES and await _drain(receive, 0)
                )
                raise self._too_large(drained)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            part = message.get("body", b"")
            size += len(part)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                drained = not more or await _drain(receive, size)
                raise self._too_large(drained)
            parts.append(part)
            if not more:
                return b"".join(parts)

    def _too_large(self, drained: bool) -> ApiError:
        return ApiError(
            413,
            f"request body exceeds {self.max_body_bytes} bytes",
            code="request_too_large",
            headers=[] if drained else [(b"connection", b"close")],
        )

    def _decode(self, body: bytes, schema: type) -> Any:
        if not body:
            raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
        try:
            req = msgspec.json.decode(body, type=schema)
            self._warn_unknown_fields(body, schema)
        except msgspec.DecodeError as exc:
            raise from_decode_error(exc, body) from None
        except RecursionError:  # msgspec's own nesting limit (about 1,000 levels)
            raise too_deep("request body") from None
        return req

    def _warn_unknown_fields(self, body: bytes, schema: type) -> None:
        """Unknown top-level fields are ignored, as vLLM does; each name is logged once."""
        raw = msgspec.json.decode(body)
        if not isinstance(raw, dict):
            return
        known = {f.name for f in msgspec.structs.fields(schema)}
        unknown = sorted(k for k in raw if k not in known)
        fresh = [k for k in unknown if k not in self._warned_fields]
        if fresh:
            self._warned_fields.update(fresh[:64])
            _log.warning(
                "ignoring unknown request fields",
                fields=[k[:64] for k in fresh][:16],
                schema=schema.__name__,
            )

    # ---- endpoints ---------------------------------------------------------------------------

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req: CompletionRequest = self._decode(
            await self._read_body(scope, receive), CompletionRequest
        )
        model = check_model(req.model, self.model_names)
        include_usage = _include_usage(req)
        jobs = completion_jobs(req, self.generation_defaults)
        renderer = CompletionRenderer(
            model,
            req.logprobs is not None,
            req.logprobs or 0,
            request_id=scope["kvactor.request_id"],
            echo=bool(req.echo),
            prompt_logprobs=req.prompt_logprobs is not None,
        )
        await self._generate(scope, receive, send, jobs, renderer, bool(req.stream), include_usage)

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req: ChatCompletionRequest = self._decode(
            await self._read_body(scope, receive), ChatCompletionRequest
        )
        model = check_model(req.model, self.model_names)
        include_usage = _include_usage(req)
        jobs = chat_jobs(req, self.context_len, self.generation_defaults)
        renderer = ChatRenderer(
            model,
            bool(req.logprobs),
            request_id=scope["kvactor.request_id"],
            parse_tools=jobs[0].parses_tools,
        )
        await self._generate(scope, receive, send, jobs, renderer, bool(req.stream), include_usage)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        cards = [self._card(name) for name in self.model_names]
        await send_response(send, 200, _json.encode(ModelList(data=cards)))

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> None:
        wanted = scope["path"][len("/v1/models/") :]
        await send_response(
            send, 200, _json.encode(self._card(check_model(wanted, self.model_names)))
        )

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.context_len)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req: TokenizeRequest = self._decode(await self._read_body(scope, receive), TokenizeRequest)
        check_model(req.model, self.model_names)
        messages = None
        if req.messages is not None:
            messages = [chat_message(m) for m in req.messages]
        try:
            reply = await self.client.tokenize(
                prompt=req.prompt,
                messages=messages,
                add_special_tokens=req.add_special_tokens,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=dict(req.chat_template_kwargs or {}),
                return_token_strs=req.return_token_strs,  # made in the same call
            )
        except GenerationError as exc:
            raise from_generation_error(exc) from None
        strs = reply.token_strs if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(reply.tokens),
            max_model_len=self.context_len,
            tokens=reply.tokens,
            token_strs=strs,
        )
        await send_response(send, 200, _json.encode(body))

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        req: DetokenizeRequest = self._decode(
            await self._read_body(scope, receive), DetokenizeRequest
        )
        check_model(req.model, self.model_names)
        try:
            text = await self.client.detokenize(list(req.tokens))
        except GenerationError as exc:
            raise from_generation_error(exc) from None
        await send_response(send, 200, _json.encode(DetokenizeResponse(prompt=text)))

    # ---- streaming sessions ----------------------------------------------------------------
    async def _open_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read_body(scope, receive)
        req: SessionCreate = self._decode(body if body.strip() else b"{}", SessionCreate)
        key = scope.get("kvactor.api_key", "")
        await self._session_reply(send, self.client.open_session(req.ttl_s, req.max_tokens, key))

    # A session opened under one API key does not exist under another: EngineClient names
    # it for the engine by (key, id), so another key names a session that is not there (404).
    async def _get_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get("kvactor.api_key", "")
        await self._session_reply(send, self.client.get_session(_session_id(scope), key))

    async def _close_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get("kvactor.api_key", "")
        await self._session_reply(send, self.client.close_session(_session_id(scope), key))

    async def _session_reply(self, send: Send, pending: Awaitable) -> None:
        try:
            info = await pending
        except GenerationError as exc:
            raise from_generation_error(exc) from None
        body = SessionObject(
            id=info.session_id,
            ttl_s=info.ttl_s,
            max_tokens=info.max_tokens,
            turns=info.turns,
            tokens=info.tokens,
            held_tokens=info.held_tokens,
            idle_s=round(info.idle_s, 3),
            busy=info.busy,
            closed=info.closed,
        )
        await send_response(send, 200, _json.encode(body))

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, _json.encode({"version": KVACTOR_VERSION}))

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.accepting():
            # A draining server is out of rotation: a load balancer stops sending to it.
            await send_response(send, 503, _json.encode({"status": "draining"}))
            return
        status = await self.health()
        down = {name: why for name, why in status.items() if why is not None}
        if down:
            body = {"status": "unavailable", "down": down}
            await send_response(send, 503, _json.encode(body))
        else:
            await send_response(send, 200, _json.encode({"status": "ok", "actors": list(status)}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        scheduler, kv = await self.stats()
        body = self.metrics.render(scheduler, kv)
        await send_response(send, 200, body, [(b"content-type", METRICS_CONTENT_TYPE)])

    # ---- generation --------------------------------------------------------------------------

    async def _generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        jobs: list[Job],
        renderer: Renderer,
        stream: bool,
        include_usage: bool,
    ) -> None:
        started = time.perf_counter()
        states = [ChoiceState() for _ in jobs]
        for job, state in zip(jobs, states):
            if job.echo:
                state.prompt_text = await self._prompt_text(job)
        outcome = _Outcome()
        tx, rx = anyio.create_memory_object_stream[_Event](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, outcome)
            async with tx:
                for job in jobs:
                    tg.start_soon(self._pump, job, scope.get("kvactor.api_key", ""), tx.clone())
            early: list[_Event] = []
            accepted = 0
            # Nothing is sent before every choice is accepted: a refusal is a plain 400.
            while accepted < len(jobs) and outcome.error is None:
                event = await _next_event(rx)
                if event.kind == _ACCEPTED:
                    accepted += 1
                elif event.kind == _ERROR:
                    outcome.error = event.error
                else:
                    early.append(event)
            if outcome.error is None:
                if stream:
                    await self._stream(
                        send, rx, early, jobs, states, renderer, include_usage, started, outcome
                    )
                else:
                    await self._respond(send, rx, early, jobs, states, renderer, started, outcome)
            tg.cancel_scope.cancel()
        if outcome.disconnected:
            self.metrics.count_aborted()
        elif outcome.error is not None:
            raise outcome.error
        elif outcome.succeeded:
            self.metrics.count_success(time.perf_counter() - started)

    async def _prompt_text(self, job: Job) -> str:
        if "prompt" in job.prompt:
            return job.prompt["prompt"]
        try:
            return await self.client.detokenize(list(job.prompt["prompt_ids"]))
        except GenerationError as exc:
            raise from_generation_error(exc) from None

    async def _pump(self, job: Job, api_key: str, tx: MemoryObjectSendStream[_Event]) -> None:
        """Run one choice; every outcome is an event (never an exception in the group)."""
        async with tx:
            try:
                session = {"session_key": api_key} if job.prompt.get("session_id") else {}
                gen = self.client.generate(
                    job.params,
                    **job.prompt,
                    **session,
                    on_accepted=lambda _: _post(tx, _Event(job.index, _ACCEPTED)),
                )
                async with contextlib.aclosing(gen):
                    async for chunk in gen:
                        _post(tx, _Event(job.index, _CHUNK, chunk=chunk))
            except GenerationError as exc:
                _post(tx, _Event(job.index, _ERROR, error=_named_error(exc, job)))
            except (TimeoutError, ChannelClosed) as exc:
                error = ApiError(
                    503, f"engine unavailable: {type(exc).__name__}: {exc}", type=UNAVAILABLE
                )
                _post(tx, _Event(job.index, _ERROR, error=error))
            except Exception as exc:
                error = ApiError(
                    500, f"internal error: {type(exc).__name__}: {exc}", type=SERVER_ERROR
                )
                _post(tx, _Event(job.index, _ERROR, error=error))

    def _record(self, event: _Event, states: list[ChoiceState], started: float) -> int:
        """Fold a chunk into its choice's state and metrics; returns its text offset."""
        chunk = event.chunk
        assert chunk is not None
        state = states[event.index]
        if chunk.token_ids:
            now = time.perf_counter()
            if state.first_token_at is None:
                self.metrics.ttft.observe(now - started)
                state.first_token_at = now
            else:
                self.metrics.itl.observe(now - (state.last_token_at or now))
            state.last_token_at = now
        offset = state.add(chunk)
        if chunk.finish_reason is not None:
            self.metrics.count_finished(
                chunk.finish_reason,
                chunk.prompt_tokens,
                chunk.completion_tokens,
                chunk.cached_tokens,
                state.queue_time_s,
            )
        return offset

    async def _respond(
        self,
        send: Send,
        rx: MemoryObjectReceiveStream[_Event],
        early: list[_Event],
        jobs: list[Job],
        states: list[ChoiceState],
        renderer: Renderer,
        started: float,
        outcome: _Outcome,
    ) -> None:
        remaining = len(jobs)
        queue = list(early)
        while remaining:
            event = queue.pop(0) if queue else await _next_event(rx)
            if event.kind == _ERROR:
                outcome.error = event.error
                return
            if event.kind == _CHUNK:
                self._record(event, states, started)
                remaining -= event.chunk.finish_reason is not None
        body = _json.encode(renderer.final(states, usage_of(jobs, states)))
        outcome.completed = outcome.succeeded = True
        await send_response(send, 200, body)

    async def _stream(
        self,
        send: Send,
        rx: MemoryObjectReceiveStream[_Event],
        early: list[_Event],
        jobs: list[Job],
        states: list[ChoiceState],
        renderer: Renderer,
        include_usage: bool,
        started: float,
        outcome: _Outcome,
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        out: list[bytes] = []
        remaining = len(jobs)
        try:
            out += [sse_event(o) for job in jobs if (o := renderer.opening(job.index)) is not None]
            remaining = await self._stream_events(
                send, rx, early, jobs, states, renderer, started, out
            )
            if include_usage and not remaining:
                out.append(sse_event(renderer.usage_event(usage_of(jobs, states))))
        except Exception as exc:
            # Invariant: a stream that started always ends with an error event or its last
            # chunk, then [DONE]; a failure here (a rendering bug) must not cut it silently.
            _log.error("stream failed after its response started", exc_info=exc)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type=SERVER_ERROR)
            out.append(sse_event(ErrorBody(error=error.detail)))
            self.metrics.count_error(error.status)
        out.append(DONE_EVENT)
        outcome.completed = True
        outcome.succeeded = not remaining
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})

    async def _stream_events(
        self,
        send: Send,
        rx: MemoryObjectReceiveStream[_Event],
        early: list[_Event],
        jobs: list[Job],
        states: list[ChoiceState],
        renderer: Renderer,
        started: float,
        out: list[bytes],
    ) -> int:
        """Stream chunks until every choice finished or one failed; how many did not finish.
        Events not yet sent are left in `out`."""
        remaining = len(jobs)
        queue = list(early)
        while remaining:
            # Write every event already queued in one send (one syscall per batch of chunks).
            if not queue:
                if out:
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
                    out.clear()
                # While a request waits or prefills, a comment keeps proxies from timing out.
                with anyio.move_on_after(self.keepalive_s) as waited:
                    queue.append(await _next_event(rx))
                if waited.cancelled_caught:
                    await send(
                        {"type": "http.response.body", "body": KEEPALIVE_EVENT, "more_body": True}
                    )
                    continue
                while True:
                    try:
                        queue.append(rx.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
            event = queue.pop(0)
            if event.kind == _ERROR:
                assert event.error is not None
                out.append(sse_event(ErrorBody(error=event.error.detail)))
                self.metrics.count_error(event.error.status)
                break
            if event.kind != _CHUNK:
                continue
            assert event.chunk is not None
            offset = self._record(event, states, started)
            delta = renderer.delta(event.index, event.chunk, offset, states[event.index])
            if delta is not None:
                out.append(sse_event(delta))
            remaining -= event.chunk.finish_reason is not None
        return remaining


async def _next_event(rx: MemoryObjectReceiveStream[_Event]) -> _Event:
    try:
        return await rx.receive()
    except anyio.EndOfStream:
        # Every choice's task ended without finishing: the engine went away.
        error = ApiError(503, "the engine ended the request without finishing it", type=UNAVAILABLE)
        return _Event(-1, _ERROR, error=error)


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope, outcome: _Outcome) -> None:
    """Cancel the request's task group when the client disconnects mid-request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not outcome.completed:
                outcome.disconnected = True
                scope.cancel()
            return


async def _drain(receive: Receive, already: int) -> bool:
    """Read and drop the rest of a body; True when it ended within DRAIN_LIMIT_BYTES."""
    size = already
    while size <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


def _session_id(scope: Scope) -> str:
    sid = scope["path"][len("/v1/sessions/") :]
    if not sid or "/" in sid:
        raise ApiError(404, f"no route {clip(scope['path'])}", type=NOT_FOUND, code="not_found")
    return sid


def _request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    given = _header(scope, b"x-request-id")
    if given and len(given) <= 128:
        text = given.decode("latin-1")
        if all(c.isalnum() or c in "-_.:" for c in text):
            return text
    return uuid.uuid4().hex


def _named_error(exc: GenerationError, job: Job) -> ApiError:
    """The engine's error, naming the request's own field where the engine named its
    generic one (`constraint` is `response_format`, `structured_outputs`, `tools`, ...)."""
    error = from_generation_error(exc)
    if job.constraint_param and exc.message.startswith("constraint:"):
        text = job.constraint_param + exc.message.removeprefix("constraint")
        return ApiError(error.status, text, param=job.constraint_param)
    return error


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _include_usage(req: SamplingRequest) -> bool:
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)
