"""The gateway actor: owns the HTTP server (uvicorn) and is the frontend of its requests.

A `FrontendActor`: it is the `reply_to` of every request its `EngineClient` submits, and
routes each chunk to the request's stream. `on_start` binds
the listening socket itself, so a port in use fails `on_start` (the actor crashes loudly
and the engine stops), then serves uvicorn in a background task of the actor. The engine
owns signals; uvicorn's signal capture is turned off. Stopping the actor closes the
listener and every connection (in-flight requests see a disconnect and abort).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence

import anyio
import uvicorn

from actors.frontends.base import FrontendActor
from actors.frontends.http.app import MAX_BODY_BYTES, GatewayApp
from actors.frontends.http.metrics import GatewayMetrics
from actors.frontends.http.protocol import guarded_h11_protocol
from actors.runtime import RemoteError
from transport.channel import ChannelClosed
from transport.messages.alloc import KvStats, KvStatsRequest
from transport.messages.engine import SchedulerStats, SchedulerStatsRequest
from transport.messages.radix import TreeDigest, TreeDigestRequest

HEALTH_TIMEOUT_S = 1.0
STATS_TIMEOUT_S = 2.0
_SHUTDOWN_GRACE_S = 1.0  # in-flight requests get this long to notice the disconnect


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside an engine: the engine's supervisor owns SIGINT / SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket; raises OSError (e.g. address in use) right here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class GatewayActor(FrontendActor):
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | list[str] | None = None,  # any of several keys
        model_names: Sequence[str] = ("gemma-3-270m",),
        context_len: int = 4096,
        watched_actors: Sequence[str] = (),
        tokenizer: str = "tokenizer",
        scheduler: str = "scheduler",
        allocator: str = "allocator",
        radix: str | None = "radix",  # the prefix cache's actor (None: none runs)
        max_body_bytes: int = MAX_BODY_BYTES,
        generation_defaults: dict | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "",
        responses_max_stored: int = 1024,
        responses_ttl_s: float = 3600.0,
        responses_max_sessions: int = 4,
        allowed_origins: Sequence[str] = (),
        sse_keepalive_s: float = 5.0,
        stuck_after_s: float = 120.0,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        keepalive_timeout_s: float = 5.0,
        max_connections: int = 1024,
        cache_config: dict[str, str] | None = None,  # vllm:cache_config_info's labels
        instance_id: str = "",  # /health reports it when set
    ) -> None:
        super().__init__(tokenizer)
        self.model_names = list(model_names)
        self.generation_defaults = dict(generation_defaults or {})
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.responses_max_stored = responses_max_stored
        self.responses_ttl_s = responses_ttl_s
        self.responses_max_sessions = responses_max_sessions
        self.allowed_origins = list(allowed_origins)
        self.sse_keepalive_s = sse_keepalive_s
        self.stuck_after_s = stuck_after_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_connections = max_connections
        self.instance_id = instance_id
        self.host = host
        self.port = port
        self.api_key = api_key or None
        self.model_name = self.model_names[0]
        self.context_len = context_len
        self.watched_actors = list(watched_actors)
        self.scheduler_name = scheduler
        self.allocator_name = allocator
        self.radix_name = radix
        self.max_body_bytes = max_body_bytes
        self.metrics = GatewayMetrics(self.model_name, context_len, cache_config)
        self.bound_port: int | None = None
        self._sock: socket.socket | None = None
        self._server: _EmbeddedServer | None = None

    async def on_start(self) -> None:
        await super().on_start()
        assert self.client is not None
        self.app = GatewayApp(
            client=self.client,
            model_names=self.model_names,
            context_len=self.context_len,
            generation_defaults=self.generation_defaults,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            responses_max_stored=self.responses_max_stored,
            responses_ttl_s=self.responses_ttl_s,
            responses_max_sessions=self.responses_max_sessions,
            allowed_origins=self.allowed_origins,
            keepalive_s=self.sse_keepalive_s,
            api_key=self.api_key,
            health=self.probe_health,
            stats=self.engine_stats,
            digest=self.tree_digest if self.radix_name else None,
            metrics=self.metrics,
            max_body_bytes=self.max_body_bytes,
            body_timeout_s=self.body_timeout_s,
            accepting=lambda: self.accepting,
            instance_id=self.instance_id,
        )
        self._sock = bind_listener(self.host, self.port)
        self.bound_port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.bound_port,
            lifespan="off",
            log_level="warning",
            log_config=None,
            access_log=False,
            interface="asgi3",
            ws="none",
            http=guarded_h11_protocol(self.header_timeout_s, self.max_connections),
            timeout_keep_alive=max(1, round(self.keepalive_timeout_s)),
            limit_concurrency=self.max_connections,
        )
        self._server = _EmbeddedServer(config)
        self.spawn(self._serve)
        self.log.info("gateway listening", host=self.host, port=self.bound_port)

    async def _serve(self) -> None:
        assert self._server is not None and self._sock is not None
        try:
            await self._server.serve(sockets=[self._sock])
        except SystemExit as exc:  # uvicorn's way of failing start-up
            raise RuntimeError(f"HTTP server failed to start (exit code {exc.code})") from None
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_server()
        raise RuntimeError("HTTP server stopped on its own")

    async def _close_server(self) -> None:
        """Stop listening, end every open stream with an error event (its client learns why
        and gets `[DONE]`), give the responses a moment to be written, then close every
        connection (a request still running sees a disconnect and aborts)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        server.force_exit = True
        for listener in getattr(server, "servers", []):
            listener.close()
        self.accepting = False
        self.router.fail_all("the server is shutting down")
        state = server.server_state
        with anyio.move_on_after(_SHUTDOWN_GRACE_S):
            while state.tasks:
                await anyio.sleep(0.02)
        for connection in list(state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()
        with anyio.move_on_after(_SHUTDOWN_GRACE_S):
            while state.tasks:
                await anyio.sleep(0.02)
        for task in list(state.tasks):
            task.cancel()
        if self._sock is not None:
            self._sock.close()

    async def on_stop(self) -> None:
        await self._close_server()
        await super().on_stop()
        if self._sock is not None:
            self._sock.close()

    # ---- probes given to the app -------------------------------------------------------------

    async def probe_health(self) -> dict[str, str | None]:
        """Ping every watched actor at once: None when it answered within the timeout and is
        making progress. An actor answers while it works (a long forward step is busy, not
        down); one whose current message has run past `stuck_after_s` is down."""
        status: dict[str, str | None] = {}

        async def probe(name: str) -> None:
            try:
                pong = await self.ref(name).ping(timeout=HEALTH_TIMEOUT_S)
            except (TimeoutError, RemoteError, ChannelClosed, KeyError) as exc:
                status[name] = f"{type(exc).__name__}: {exc}"
                return
            stuck = pong.busy_s > self.stuck_after_s
            status[name] = f"stuck: one message has run for {pong.busy_s:.0f} s" if stuck else None

        async with anyio.create_task_group() as tg:
            for name in self.watched_actors:
                tg.start_soon(probe, name)
        return {name: status[name] for name in self.watched_actors}

    async def engine_stats(self) -> tuple[SchedulerStats | None, KvStats | None]:
        results: dict[str, object] = {}

        async def fetch(key: str, actor: str, request, expect) -> None:
            with contextlib.suppress(TimeoutError, RemoteError, ChannelClosed, KeyError):
                results[key] = await self.ref(actor).call(
                    request, expect=expect, timeout=STATS_TIMEOUT_S
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch, "s", self.scheduler_name, SchedulerStatsRequest(), SchedulerStats)
            tg.start_soon(fetch, "k", self.allocator_name, KvStatsRequest(), KvStats)
        return results.get("s"), results.get("k")  # type: ignore[return-value]

    async def tree_digest(self, since: int) -> TreeDigest | None:
        """The radix actor's digest (None when it does not answer in time)."""
        assert self.radix_name is not None
        with contextlib.suppress(TimeoutError, RemoteError, ChannelClosed, KeyError):
            return await self.ref(self.radix_name).call(
                TreeDigestRequest(since=since), expect=TreeDigest, timeout=STATS_TIMEOUT_S
            )
        return None

    def stats(self) -> dict[str, int | float]:
        requests = {f"requests_{k}": v for k, v in self.metrics.requests.items()}
        return {**super().stats(), **requests}
