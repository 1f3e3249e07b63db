"""The gateway's ASGI application: routes, auth, CORS, and the OpenAI endpoints.

Plain ASGI 3 (no framework). `GatewayApp` is given the engine-facing `EngineClient` and two
probes (actor health, engine stats) by its owner, the gateway actor, so it holds no actor
state itself. Order of checks for every request: route (404), method (405), API key on
/v1/* (401), body size while reading (413), strict decode (400), model name (404), then the
engine's own validation (400). A refused request never reaches the scheduler.

Bodies are read and decoded by `asgi.RequestBodies`; a generation request (completions,
chat) is answered by `streaming.GenerationResponder`, as one JSON body or an SSE stream.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from actors.frontends.base import EngineClient, GenerationError
from actors.frontends.http import anthropic, responses
from actors.frontends.http.asgi import (
    JSON_HEADERS,
    ClientGone,
    Receive,
    RequestBodies,
    Scope,
    Send,
    header,
    path_id,
    request_id,
    send_response,
)
from actors.frontends.http.constraints import declared_tools
from actors.frontends.http.errors import (
    NOT_FOUND,
    UNAVAILABLE,
    ApiError,
    from_generation_error,
)
from actors.frontends.http.generation import (
    ChatRenderer,
    CompletionRenderer,
    Extras,
    Job,
    chat_jobs,
    chat_message,
    check_model,
    clip,
    completion_jobs,
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
from actors.frontends.http.streaming import SSE_KEEPALIVE_S, GenerationResponder
from transport.messages.alloc import KvStats
from transport.messages.engine import SchedulerStats
from transport.messages.radix import TreeDigest

MAX_BODY_BYTES = 2 * 1024 * 1024
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this
try:
    KVACTOR_VERSION = importlib.metadata.version("kvactor")
except importlib.metadata.PackageNotFoundError:  # running from a plain checkout
    KVACTOR_VERSION = "0.1.0"

HealthProbe = Callable[[], Awaitable[dict[str, str | None]]]  # actor -> None (up) or why down
StatsProbe = Callable[[], Awaitable[tuple[SchedulerStats | None, KvStats | None]]]
DigestProbe = Callable[[int], Awaitable[TreeDigest | None]]  # since -> digest (None: no answer)

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    """One path of the gateway: its handlers by method, its `endpoint` label in the
    metrics, the API whose error shape it answers with, and whether it generates (refused
    while the server drains). A `prefix` route serves every path below it (`/v1/models/x`)."""

    path: str
    methods: dict[str, Handler]
    endpoint: str
    api: str = "openai"
    gen: bool = False
    prefix: bool = False
    auth: bool = False  # needs the API key (every /v1/ route does)


class RouteTable:
    """Every route of the app, declared in one list; exact paths first, then prefixes."""

    def __init__(self, routes: list[Route]) -> None:
        self.exact = {r.path: r for r in routes if not r.prefix}
        self.prefixes = sorted((r for r in routes if r.prefix), key=lambda r: -len(r.path))

    def find(self, path: str) -> Route | None:
        route = self.exact.get(path)
        if route is None:
            route = next((r for r in self.prefixes if path.startswith(r.path)), None)
        return route


_json = msgspec.json.Encoder()


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
        tool_call_parser: str = "auto",
        reasoning_parser: str = "",
        allowed_origins: list[str] | None = None,
        keepalive_s: float = SSE_KEEPALIVE_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        accepting: Callable[[], bool] = lambda: True,
        responses_max_stored: int = responses.MAX_STORED_RESPONSES,
        responses_ttl_s: float = responses.STORED_RESPONSE_TTL_S,
        responses_max_sessions: int = responses.MAX_RESPONSE_SESSIONS,
        digest: DigestProbe | None = None,
        instance_id: str = "",
    ) -> None:
        if not model_names:
            raise ValueError("the gateway needs at least one model name")
        self.client = client
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        self.context_len = context_len
        self.generation_defaults = dict(generation_defaults or {})
        self.tool_call_parser = tool_call_parser  # the format tool calls are parsed in
        self.reasoning_parser = reasoning_parser  # "" = no reasoning split
        self.allowed_origins = set(allowed_origins or ())
        # Any of these keys opens /v1/* (vLLM's --api-key takes several); none: no auth.
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self._api_keys = [k.encode() for k in keys if k]
        self.health = health
        self.stats = stats
        self.digest = digest
        self.instance_id = instance_id  # /health's "instance", when set
        self.metrics = metrics or GatewayMetrics(self.model_name, context_len)
        self.bodies = RequestBodies(max_body_bytes, body_timeout_s)
        self.responder = GenerationResponder(client, self.metrics, keepalive_s)
        self.accepting = accepting
        self.responses = responses.ResponseStore(
            responses_max_stored, responses_ttl_s, responses_max_sessions
        )
        self.created = int(time.time())
        self.routes = RouteTable(
            [
                Route("/v1/completions", {"POST": self._completions}, "completions", gen=True),
                Route(
                    "/v1/chat/completions",
                    {"POST": self._chat_completions},
                    "chat_completions",
                    gen=True,
                ),
                Route("/v1/responses", {"POST": self._responses}, "responses", gen=True),
                Route(
                    "/v1/responses/",
                    {"GET": self._get_response, "DELETE": self._delete_response},
                    "responses",
                    prefix=True,
                ),
                Route(
                    "/v1/messages", {"POST": self._messages}, "messages", api="anthropic", gen=True
                ),
                Route(
                    "/v1/messages/count_tokens",
                    {"POST": self._count_tokens},
                    "messages_count_tokens",
                    api="anthropic",
                ),
                Route("/v1/models", {"GET": self._models}, "models"),
                Route("/v1/models/", {"GET": self._model}, "models", prefix=True),
                Route("/v1/sessions", {"POST": self._open_session}, "sessions"),
                Route(
                    "/v1/sessions/",
                    {
                        "GET": self._get_session,
                        "DELETE": self._close_session,
                        "POST": self._session_action,
                    },
                    "sessions",
                    prefix=True,
                ),
                Route("/health", {"GET": self._health}, "health"),
                Route("/metrics", {"GET": self._metrics}, "metrics"),
                Route("/tokenize", {"POST": self._tokenize}, "tokenize"),
                Route("/detokenize", {"POST": self._detokenize}, "detokenize"),
                Route("/version", {"GET": self._version}, "version"),
                Route("/cache_digest", {"GET": self._cache_digest}, "cache_digest", auth=True),
                Route(
                    "/tokenizer_info", {"GET": self._tokenizer_info}, "tokenizer_info", auth=True
                ),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        req_id = request_id(scope)
        scope["kvactor.request_id"] = req_id
        extra = [(b"x-request-id", req_id.encode()), *self._cors_headers(scope)]
        head_only = scope["method"] == "HEAD"

        raw_send = send

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif head_only and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await raw_send(message)

        send = send_with_headers
        route = self.routes.find(scope["path"])
        scope["kvactor.endpoint"] = route.endpoint if route else "unknown"
        api = route.api if route else "openai"
        try:
            await self._dispatch(route, scope, receive, send)
        except ApiError as err:
            self.metrics.count_error(err.status, scope["kvactor.endpoint"])
            await send_response(send, err.status, err.body(api), [*JSON_HEADERS, *err.headers])
        except ClientGone:
            self.metrics.count_aborted(scope["kvactor.endpoint"])

    async def _dispatch(
        self, route: Route | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        path: str = scope["path"]
        if route is None:
            raise ApiError(404, f"no route {clip(path)}", type=NOT_FOUND, code="not_found")
        methods = route.methods
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
        if route.auth or path.startswith("/v1/"):
            # The key a request authorized with owns the sessions it opens (below).
            scope["kvactor.api_key"] = self._authorize(scope)
        if route.gen and method == "POST" and not self.accepting():
            raise ApiError(
                503,
                "the server is shutting down and takes no new requests; retry elsewhere",
                type=UNAVAILABLE,
                code="shutting_down",
                headers=[(b"connection", b"close"), (b"retry-after", b"1")],
            )
        await handler(scope, receive, send)

    def _cors_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        origin = header(scope, b"origin")
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
            wanted = header(scope, b"access-control-request-headers") or b"*"
            headers += [
                (b"access-control-allow-methods", allowed.encode()),
                (b"access-control-allow-headers", wanted),
                (b"access-control-max-age", b"600"),
            ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _authorize(self, scope: Scope) -> str:
        """The configured key the request carries, in `Authorization: Bearer` or Anthropic's
        `x-api-key` ("" when no keys are configured); 401 without one."""
        if not self._api_keys:
            return ""
        given = header(scope, b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if given is None and (anthropic_key := header(scope, b"x-api-key")) is not None:
            given, scheme, token = anthropic_key, b"bearer", anthropic_key  # Anthropic's header
        if given is None:
            raise ApiError(
                401,
                "Missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
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

    # ---- endpoints ---------------------------------------------------------------------------

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req: CompletionRequest = self.bodies.decode(
            await self.bodies.read(scope, receive), CompletionRequest
        )
        model = check_model(req.model, self.model_names)
        include_usage = _include_usage(req)
        jobs = completion_jobs(req, self.generation_defaults)
        renderer = CompletionRenderer(
            model,
            req.logprobs is not None,
            request_id=scope["kvactor.request_id"],
            echo=bool(req.echo),
            extras=Extras.of(req, _continuous_usage(req)),
        )
        await self.responder.run(
            scope, receive, send, jobs, renderer, bool(req.stream), include_usage
        )

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        req: ChatCompletionRequest = self.bodies.decode(
            await self.bodies.read(scope, receive), ChatCompletionRequest
        )
        model = check_model(req.model, self.model_names)
        include_usage = _include_usage(req)
        jobs = self.chat_jobs(req)
        renderer = ChatRenderer(
            model,
            bool(req.logprobs),
            request_id=scope["kvactor.request_id"],
            policy=jobs[0].policy,
            extras=Extras.of(req, _continuous_usage(req)),
        )
        await self.responder.run(
            scope, receive, send, jobs, renderer, bool(req.stream), include_usage
        )

    def chat_jobs(self, req: ChatCompletionRequest) -> list[Job]:
        """The engine jobs of a chat request (what the Responses and Messages APIs translate
        into, too), with this server's defaults and output parsers."""
        return chat_jobs(
            req,
            self.context_len,
            self.generation_defaults,
            tool_format=self.tool_call_parser,
            reasoning=self.reasoning_parser,
        )

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await responses.create(self, scope, receive, send)

    async def _get_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        await responses.retrieve(self, scope, receive, send)

    async def _delete_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        await responses.delete(self, scope, receive, send)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        await anthropic.messages(self, scope, receive, send)

    async def _count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        await anthropic.count_tokens(self, scope, receive, send)

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
        req: TokenizeRequest = self.bodies.decode(
            await self.bodies.read(scope, receive), TokenizeRequest
        )
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
                tools=[t.openai() for t in declared_tools(req.tools)],
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
        req: DetokenizeRequest = self.bodies.decode(
            await self.bodies.read(scope, receive), DetokenizeRequest
        )
        check_model(req.model, self.model_names)
        try:
            text = await self.client.detokenize(list(req.tokens))
        except GenerationError as exc:
            raise from_generation_error(exc) from None
        await send_response(send, 200, _json.encode(DetokenizeResponse(prompt=text)))

    # ---- streaming sessions ----------------------------------------------------------------
    async def _open_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self.bodies.read(scope, receive)
        req: SessionCreate = self.bodies.decode(body if body.strip() else b"{}", SessionCreate)
        key = scope.get("kvactor.api_key", "")
        await self._session_reply(
            send,
            self.client.open_session(req.ttl_s, req.max_tokens, key, req.priority, req.retain_s),
        )

    # A session opened under one API key does not exist under another: EngineClient names
    # it for the engine by (key, id), so another key names a session that is not there (404).
    async def _get_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get("kvactor.api_key", "")
        await self._session_reply(send, self.client.get_session(_session_id(scope), key))

    async def _close_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get("kvactor.api_key", "")
        await self._session_reply(send, self.client.close_session(_session_id(scope), key))

    async def _session_action(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/sessions/{id}/offload: move the session's KV out of the pool now;
        POST /v1/sessions/{id}/prefetch: bring it back into the pool now."""
        key = scope.get("kvactor.api_key", "")
        path = scope.get("path", "")
        if path.endswith("/prefetch"):
            session_id = path_id(scope, "/v1/sessions/", suffix="/prefetch")
            await self._session_reply(send, self.client.prefetch_session(session_id, key))
            return
        session_id = path_id(scope, "/v1/sessions/", suffix="/offload")
        await self._session_reply(send, self.client.offload_session(session_id, key))

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
            pool_tokens=info.pool_tokens,
            priority=info.priority,
            retain_s=info.retain_s,
        )
        await send_response(send, 200, _json.encode(body))

    async def _tokenizer_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's /tokenizer_info (behind the API key: it shows the chat template)."""
        try:
            info = await self.client.tokenizer_info()
        except GenerationError as exc:
            raise from_generation_error(exc) from None
        await send_response(send, 200, _json.encode(info))

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_response(send, 200, _json.encode({"version": KVACTOR_VERSION}))

    async def _cache_digest(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The prefix cache's content as hashes (kvcore.prefix_digest), for a router:
        `?since=V` answers `unchanged` when the tree is still at version V."""
        since = -1
        for part in scope.get("query_string", b"").decode("latin-1").split("&"):
            name, _, value = part.partition("=")
            if name == "since":
                try:
                    since = int(value)
                except ValueError:
                    raise ApiError(400, "since: must be an integer", param="since") from None
        if self.digest is None:
            raise ApiError(404, "this engine keeps no prefix cache (kv.radix is off)")
        digest = await self.digest(since)
        if digest is None:
            raise ApiError(503, "the prefix cache did not answer in time; ask again")
        await send_response(send, 200, _json.encode(digest))

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
            body = {"status": "ok", "actors": list(status)}
            if self.instance_id:
                body["instance"] = self.instance_id
            await send_response(send, 200, _json.encode(body))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        scheduler, kv = await self.stats()
        body = self.metrics.render(scheduler, kv)
        await send_response(send, 200, body, [(b"content-type", METRICS_CONTENT_TYPE)])


def _session_id(scope: Scope) -> str:
    return path_id(scope, "/v1/sessions/")


def _include_usage(req: SamplingRequest) -> bool:
    if req.stream_options is not None and not req.stream:
        raise ApiError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: SamplingRequest) -> bool:
    """vLLM's continuous_usage_stats: every chunk carries the usage so far (with
    include_usage, as vLLM requires)."""
    opts = req.stream_options
    return bool(req.stream and opts and opts.include_usage and opts.continuous_usage_stats)
