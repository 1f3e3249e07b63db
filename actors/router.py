"""The data-parallel router: one OpenAI-compatible HTTP front for N complete engines.

Each request goes to one replica, by these rules in order:
  1. a turn of a streaming session (`session_id` in the body, `/v1/sessions/{id}...`) goes
     to the replica that opened the session (its KV is there);
  2. a Responses follow-up (`previous_response_id`, `/v1/responses/{id}`) goes to the
     replica that stored that response;
  3. any other request goes where its prompt's longest prefix was sent before, when that
     prefix is more than half the prompt (the replica's prefix cache likely holds it) and
     that replica is not far busier than the least busy one; else to the least busy
     replica (fewest requests in flight). This is SGLang's cache-aware policy: the router
     keeps, per replica, the prompts it sent there (an approximation of that replica's
     radix tree, not the tree itself);
  4. `POST /v1/sessions` opens the session on the least busy replica.
A replica is polled (`/health`) every second; one that fails is taken out (the rules
skip it) until it answers again, and `/health` here says "degraded" (200) while at least
one replica serves, 503 when none does. A request whose replica fails before answering
gets 503 `replica_unavailable`; a stream cut mid-way ends with an error event and
`[DONE]`. `/metrics` has the router's own figures per replica; each replica's own
`/metrics` stays on the replica.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import anyio
import httpx

from actors.runtime.logging import get_logger

_log = get_logger("router")

HEALTH_EVERY_S = 1.0
MAX_BODY_BYTES = 64 << 20
TEXTS_PER_REPLICA = 1024  # prompts remembered per replica (the cache-aware policy's record)
TEXT_CHARS = 16384  # of each, the first this many characters
CACHE_THRESHOLD = 0.5  # a prefix longer than this share of the prompt routes by cache
BALANCE_ABS = 16  # ... unless that replica has this many more requests in flight
MAX_REMEMBERED_IDS = 100_000  # sessions and responses mapped to their replica
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"]+)"')


@dataclass
class Replica:
    url: str
    up: bool = False
    in_flight: int = 0
    routed: dict[str, int] = field(default_factory=dict)  # reason -> requests
    texts: deque = field(default_factory=lambda: deque(maxlen=TEXTS_PER_REPLICA))

    def matched(self, text: str) -> int:
        """The longest prefix of `text` this replica was sent (characters)."""
        return max((_common_prefix(text, t) for t in self.texts), default=0)


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slices: C-speed comparisons
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prompt_text(body: dict) -> str:
    """What a request's prefix is made of, as text: the prompt, or the system text and
    messages / input in order."""
    parts = []
    for key in ("system", "instructions", "prompt", "messages", "input"):
        value = body.get(key)
        if value is not None:
            parts.append(value if isinstance(value, str) else json.dumps(value))
    return "\n".join(parts)[:TEXT_CHARS]


class _Bounded(OrderedDict):
    def remember(self, key: str, value: int) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > MAX_REMEMBERED_IDS:
            self.popitem(last=False)


class Router:
    """An ASGI app proxying to `urls` (each a replica's base URL)."""

    def __init__(self, urls: list[str]) -> None:
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.sessions = _Bounded()  # session id -> replica index
        self.responses = _Bounded()  # response id -> replica index
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    # ---- choosing --------------------------------------------------------------------

    def choose(self, method: str, path: str, body: dict) -> tuple[int | None, str]:
        """(replica index, reason); None: no replica for it (the reason says why)."""
        parts = path.strip("/").split("/")
        if parts[:2] == ["v1", "sessions"] and len(parts) >= 3:
            return self._pinned(self.sessions, parts[2], "session")
        if isinstance(body.get("session_id"), str):
            return self._pinned(self.sessions, body["session_id"], "session")
        if parts[:2] == ["v1", "responses"] and len(parts) >= 3:
            return self._pinned(self.responses, parts[2], "response")
        if isinstance(body.get("previous_response_id"), str):
            return self._pinned(self.responses, body["previous_response_id"], "response")
        up = [i for i, r in enumerate(self.replicas) if r.up]
        if not up:
            return None, "no replica is serving"
        least = min(
            up, key=lambda i: (self.replicas[i].in_flight, sum(self.replicas[i].routed.values()))
        )
        text = prompt_text(body)
        if method == "POST" and text:
            best = max(up, key=lambda i: self.replicas[i].matched(text))
            share = self.replicas[best].matched(text) / len(text)
            busier = self.replicas[best].in_flight - self.replicas[least].in_flight
            if share > CACHE_THRESHOLD and busier <= BALANCE_ABS:
                return best, "prefix"
        return least, "least_load"

    def _pinned(self, ids: _Bounded, key: str, kind: str) -> tuple[int | None, str]:
        index = ids.get(key)
        if index is None:
            return None, f"no {kind} {key} was opened through this router"
        if not self.replicas[index].up:
            return None, f"the replica holding {kind} {key} is down"
        ids.move_to_end(key)
        return index, kind

    # ---- serving ---------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await self._health(send)
            return
        if path == "/metrics":
            await _respond(send, 200, self.metrics_text().encode(), b"text/plain; version=0.0.4")
            return
        raw = await _read_body(receive)
        if raw is None:
            await _error(send, 413, "the body is too large", "body_too_large")
            return
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        index, reason = self.choose(method, path, body)
        if index is None:
            status = 503 if "serving" in reason or "down" in reason else 404
            await _error(
                send, status, reason, "replica_unavailable" if status == 503 else "not_found"
            )
            return
        await self._proxy(index, reason, scope, raw, body, send)

    async def _proxy(self, index, reason, scope, raw, body, send) -> None:
        replica = self.replicas[index]
        replica.routed[reason] = replica.routed.get(reason, 0) + 1
        if reason in ("prefix", "least_load") and (text := prompt_text(body)):
            replica.texts.append(text)
        query = scope.get("query_string", b"").decode()
        url = replica.url + scope["path"] + (f"?{query}" if query else "")
        headers = [
            (k.decode(), v.decode())
            for k, v in scope["headers"]
            if k.lower() not in (b"host", b"content-length", b"connection")
        ]
        replica.in_flight += 1
        started = False
        try:
            request = self.client.build_request(scope["method"], url, headers=headers, content=raw)
            upstream = await self.client.send(request, stream=True)
            try:
                kept = [
                    (k.encode(), v.encode())
                    for k, v in upstream.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")
                ]
                await send(
                    {"type": "http.response.start", "status": upstream.status_code, "headers": kept}
                )
                started = True
                head = b""
                async for chunk in upstream.aiter_raw():
                    if len(head) < 8192:
                        head += chunk[: 8192 - len(head)]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                if upstream.status_code == 200:
                    self._remember(index, scope, head)
            finally:
                await upstream.aclose()
        except httpx.HTTPError as exc:
            _log.warning("replica failed a request", replica=replica.url, error=str(exc))
            replica.up = False  # until its next health check says otherwise
            message = f"replica {index} ({replica.url}) failed: {exc}"
            if not started:
                await _error(send, 503, message, "replica_unavailable")
            else:  # a stream cut mid-way: an error event, then the end
                event = json.dumps({"error": {"message": message, "type": "replica_unavailable"}})
                tail = f"data: {event}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            replica.in_flight -= 1

    def _remember(self, index: int, scope, head: bytes) -> None:
        """Sessions opened and responses stored through this router stay on their replica."""
        path = scope["path"].rstrip("/")
        if path == "/v1/sessions" and scope["method"] == "POST":
            try:
                self.sessions.remember(json.loads(head)["id"], index)
            except (ValueError, KeyError, TypeError):
                pass
        elif path == "/v1/responses" and (found := _RESPONSE_ID.search(head)):
            self.responses.remember(found.group(1).decode(), index)

    async def _health(self, send) -> None:
        down = [r.url for r in self.replicas if not r.up]
        if len(down) == len(self.replicas):
            body = {"status": "unavailable", "down": down}
            await _respond(send, 503, json.dumps(body).encode())
            return
        body = {"status": "degraded", "down": down} if down else {"status": "ok"}
        body["replicas"] = [r.url for r in self.replicas]
        await _respond(send, 200, json.dumps(body).encode())

    async def poll_health(self) -> None:
        """Forever: each replica's /health, every HEALTH_EVERY_S; up means 200."""
        while True:
            async with anyio.create_task_group() as tg:
                for replica in self.replicas:
                    tg.start_soon(self._check, replica)
            await anyio.sleep(HEALTH_EVERY_S)

    async def _check(self, replica: Replica) -> None:
        try:
            up = (await self.client.get(replica.url + "/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            up = False
        if up != replica.up:
            _log.warning("replica " + ("up" if up else "down"), replica=replica.url)
        replica.up = up

    async def _lifespan(self, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    tg.start_soon(self.poll_health)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    tg.cancel_scope.cancel()
                    await self.client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def metrics_text(self) -> str:
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

        registry = CollectorRegistry()
        up = Gauge(
            "kvactor_router_replica_up",
            "1 while the replica serves",
            ["replica"],
            registry=registry,
        )
        busy = Gauge(
            "kvactor_router_replica_in_flight", "requests in flight", ["replica"], registry=registry
        )
        routed = Counter(
            "kvactor_router_routed",
            "requests sent, by rule",
            ["replica", "reason"],
            registry=registry,
        )
        for r in self.replicas:
            up.labels(r.url).set(int(r.up))
            busy.labels(r.url).set(r.in_flight)
            for reason, n in r.routed.items():
                routed.labels(r.url, reason).inc(n)
        return generate_latest(registry).decode()


async def _read_body(receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(
    send, status: int, body: bytes, content_type: bytes = b"application/json"
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _error(send, status: int, message: str, code: str) -> None:
    body = {"error": {"message": message, "type": code, "code": code}}
    await _respond(send, status, json.dumps(body).encode())
