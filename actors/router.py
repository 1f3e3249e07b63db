"""The data-parallel router: one OpenAI-compatible HTTP front for N complete engines.

Each request goes to one replica, by these rules in order:
  1. a turn of a streaming session (`session_id` in the body, `/v1/sessions/{id}...`) goes
     to the replica that opened the session (its KV is there);
  2. a Responses follow-up (`previous_response_id`, `/v1/responses/{id}`) goes to the
     replica that stored that response;
  3. any other request goes to the replica whose prefix cache holds the longest prefix of
     its prompt, when that prefix is more than half the prompt and that replica is not far
     busier than the least busy one; else to the least busy replica (fewest requests in
     flight). The router reads each replica's own radix tree: every second, with the health
     check, it fetches the tree's digest (`/cache_digest`: one 64-bit hash per cached
     64-token prefix, sent again only when the tree changed), and it matches a prompt's
     token ids (from a replica's `/tokenize`, the prompt as the engine renders it, under
     its `cache_salt`) against each digest, adding the prompts it sent there since that
     digest was made. Prompts it cannot tokenize so (the Responses and Anthropic APIs)
     fall back to SGLang's approximate policy: the prefixes of the prompts sent to each
     replica, as chained hashes of 64-character blocks of their text;
  4. `POST /v1/sessions` opens the session on the least busy replica.
A replica is polled (`/health`) every second; one that fails it is taken out (the rules
skip it) until it answers again, and `/health` here says "degraded" (200) while at least
one replica serves, 503 when none does. A request whose replica fails before answering
gets 503 `replica_unavailable` (a connection gone stale is retried once first); a stream
cut mid-way ends with an error event and `[DONE]`; requests in flight to a replica that
stays down for CUT_AFTER_S (a hung process) end the same way. A client that leaves closes the
replica's connection, so the replica aborts the request. `/metrics` has the router's own
figures per replica; each replica's own `/metrics` stays on the replica.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import anyio
import httpx
import numpy as np

from actors.runtime.logging import get_logger
from kvcore.prefix_digest import DIGEST_BLOCK, matched_blocks, prefix_hashes, unpack
from kvcore.salt import salted_tokens

_log = get_logger("router")

HEALTH_EVERY_S = 1.0
TEXTS_PER_REPLICA = 1024  # prompts remembered per replica (the cache-aware policy's record)
TEXT_CHARS = 16384  # of each, the first this many characters
PREFIX_BLOCK = 64  # characters per block of that record
CACHE_THRESHOLD = 0.5  # a prefix longer than this share of the prompt routes by cache
BALANCE_ABS = 16  # ... unless that replica has this many more requests in flight
TOKENIZED_PATHS = ("/v1/completions", "/v1/chat/completions")  # matched in token ids
TOKENIZE_TIMEOUT_S = 1.0  # past this the request is routed by load (never held longer)
MIN_TOKENIZED_CHARS = 4 * DIGEST_BLOCK  # shorter prompts rarely hold a whole block
MAX_SENT_BLOCKS = 1024  # of a prompt sent, the record keeps this many leading blocks
MAX_REMEMBERED_IDS = 100_000  # sessions and responses mapped to their replica
CUT_AFTER_S = 10.0  # a replica down this long has its requests in flight ended
NO_REPLICA = "no replica is serving"
# Hop-by-hop and framing headers: the router frames each side itself.
_REQUEST_DROPPED = {
    b"host",
    b"content-length",
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"upgrade",
    b"expect",
}
_RESPONSE_DROPPED = {
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"date",
    b"server",
}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"]+)"')


def block_hashes(text: str) -> list[int]:
    """Chained hashes of `text`'s whole PREFIX_BLOCK-character blocks: entry k stands for
    the prefix text[: (k + 1) * PREFIX_BLOCK]."""
    out, prev = [], 0
    for start in range(0, len(text) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
        prev = hash((prev, text[start : start + PREFIX_BLOCK]))
        out.append(prev)
    return out


class PrefixRecord:
    """Prefixes sent to a replica: each prompt's chained block hashes, with reference
    counts (a prompt leaving the record takes its counts away), oldest first."""

    def __init__(self) -> None:
        self.entries: deque = deque()  # [stamp, hashes]
        self.counts: dict[int, int] = {}

    def __contains__(self, h: int) -> bool:
        return h in self.counts

    def __len__(self) -> int:
        return len(self.entries)

    def record(self, hashes: list[int], stamp: float = 0.0) -> list:
        """Add a prompt's hashes; the entry ([stamp, hashes]) is returned so its stamp
        can be set later (`forget_ended` reads it)."""
        entry = [stamp, hashes]
        self.entries.append(entry)
        for h in hashes:
            self.counts[h] = self.counts.get(h, 0) + 1
        return entry

    def forget_oldest(self, keep: int) -> None:
        """Drop entries beyond the newest `keep`."""
        while len(self.entries) > keep:
            self._uncount(self.entries.popleft()[1])

    def forget_ended(self, before: float) -> None:
        """Drop every entry stamped before `before`, wherever it is in the record (the
        others stay the same objects: their requests still stamp them)."""
        for entry in [e for e in self.entries if e[0] < before]:
            self._uncount(entry[1])
        self.entries = deque(e for e in self.entries if e[0] >= before)

    def _uncount(self, hashes: list[int]) -> None:
        for h in hashes:
            left = self.counts[h] - 1
            if left:
                self.counts[h] = left
            else:
                del self.counts[h]

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt were sent (the record is prefix-closed)."""
        return matched_blocks(hashes, self.counts)


@dataclass
class Replica:
    url: str
    up: bool = False
    in_flight: int = 0
    routed: dict[str, int] = field(default_factory=dict)  # reason -> requests
    # The approximate record: the text prefixes of the last TEXTS_PER_REPLICA prompts.
    texts: PrefixRecord = field(default_factory=PrefixRecord)
    # The replica's radix tree as its last digest listed it (None: no digest), and the
    # token prefixes sent here that it may not list yet: each entry's stamp is when its
    # request ended (inf while in flight); a digest asked for after that lists it.
    digest: set[int] | None = None
    digest_version: int = -1
    # Of the digest, the prefixes no request resumes right after (their sliding window's KV
    # is gone: `RadixTree.dead_ends`); a match backs off past them.
    dead_ends: set[int] = field(default_factory=set)
    sent: PrefixRecord = field(default_factory=PrefixRecord)
    down_since: float | None = None  # time.monotonic() of the first failed check in a row
    calls: set = field(default_factory=set)  # cancel scopes of the requests in flight here

    def record(self, hashes: list[int]) -> None:
        """Record a prompt's text prefixes (its `block_hashes`)."""
        self.texts.record(hashes)
        self.texts.forget_oldest(keep=TEXTS_PER_REPLICA)

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt's text were sent here."""
        return self.texts.matched(hashes)

    def cached(self, tokens: list[int]) -> int:
        """How many leading blocks of a prompt's token keys (its `prefix_hashes`) this
        replica's tree holds and a request can resume after, or will once the prompts
        sent since its digest ran."""
        held = 0
        if self.digest is not None:
            held = matched_blocks(tokens, self.digest)
            while held and tokens[held - 1] in self.dead_ends:
                held -= 1
        return max(held, self.sent.matched(tokens))

    def total(self) -> int:
        return sum(self.routed.values())


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


class _ClientLeft(Exception):
    pass


class Router:
    """An ASGI app proxying to `urls` (each a replica's base URL)."""

    def __init__(self, urls: list[str], max_body_bytes: int = 2 << 20, api_key: str = "") -> None:
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        # the replicas' key, for what the router asks on its own (their digests)
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_body_bytes = max_body_bytes
        self.sessions = _Bounded()  # session id -> replica index
        self.responses = _Bounded()  # response id -> replica index
        # No pool limit (each replica bounds its own queue) and idle connections dropped
        # well before a replica's keep-alive timeout closes them under a request.
        limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        self.probes = httpx.AsyncClient(timeout=2.0)  # health checks never queue behind work

    # ---- choosing --------------------------------------------------------------------

    def choose(
        self,
        method: str,
        path: str,
        body: dict,
        hashes: list[int] | None = None,
        tokens: list[int] | None = None,
        token_count: int = 0,
    ) -> tuple[int | None, int, str]:
        """(replica index, status, reason): the status is 200 when a replica is chosen,
        else the answer's (404: an unknown session or response, 503: no replica for it).
        `tokens`: the prompt's token keys as `prefix_hashes` (None: not known, so its
        text's `block_hashes` are matched instead; `hashes`: those, computed when not
        given); `token_count`: the prompt's length in tokens (0: its whole blocks')."""
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
            return None, 503, NO_REPLICA
        least = min(up, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].total()))
        if tokens is not None:
            if method == "POST" and tokens:
                cached = {i: self.replicas[i].cached(tokens) for i in up}
                best = max(up, key=cached.__getitem__)
                busier = self.replicas[best].in_flight - self.replicas[least].in_flight
                length = max(token_count, len(tokens) * DIGEST_BLOCK)
                share = cached[best] * DIGEST_BLOCK / length
                if share > CACHE_THRESHOLD and busier <= BALANCE_ABS:
                    return best, 200, "cached_prefix"
            return least, 200, "least_load"
        if hashes is None:
            hashes = block_hashes(prompt_text(body))
        if method == "POST" and hashes:
            held = {i: self.replicas[i].matched(hashes) for i in up}
            best = max(up, key=held.__getitem__)
            busier = self.replicas[best].in_flight - self.replicas[least].in_flight
            if held[best] / len(hashes) > CACHE_THRESHOLD and busier <= BALANCE_ABS:
                return best, 200, "prefix"
        return least, 200, "least_load"

    def _pinned(self, ids: _Bounded, key: str, kind: str) -> tuple[int | None, int, str]:
        index = ids.get(key)
        if index is None:
            return None, 404, f"no {kind} {key} was opened through this router"
        if not self.replicas[index].up:
            return None, 503, f"the replica holding {kind} {key} is down"
        ids.move_to_end(key)
        return index, 200, kind

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
        try:
            raw = await _read_body(receive, self.max_body_bytes)
        except _ClientLeft:
            return
        if raw is None:
            await _error(send, 413, "the body is too large", "body_too_large")
            return
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        text = prompt_text(body)
        tokens, count = None, 0
        if self._tokenizable(method, path, body, text):
            keys = await self._prompt_keys(path, body, scope["headers"])
            if keys is not None:
                tokens, count = keys
        hashes = block_hashes(text) if tokens is None else []
        index, status, reason = self.choose(method, path, body, hashes, tokens, count)
        if index is None:
            code = "not_found" if status == 404 else "replica_unavailable"
            await _error(send, status, reason, code)
            return
        replica = self.replicas[index]
        replica.routed[reason] = replica.routed.get(reason, 0) + 1
        sent = None
        if reason in ("cached_prefix", "prefix", "least_load"):
            if tokens:
                sent = replica.sent.record(tokens[:MAX_SENT_BLOCKS], math.inf)
                replica.sent.forget_oldest(keep=TEXTS_PER_REPLICA)
            elif hashes:
                replica.record(hashes)
        replica.in_flight += 1
        try:
            # The client leaving cancels the proxying: the replica's connection closes, and
            # the replica aborts the request (as for a client of its own).
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                async def proxy() -> None:
                    await self._proxy(index, scope, raw, send)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                tg.start_soon(proxy)
        finally:
            replica.in_flight -= 1
            if sent is not None:
                sent[0] = time.monotonic()  # its prefix is in the tree from now on

    # ---- the prompt's token keys ---------------------------------------------------------

    def _tokenizable(self, method: str, path: str, body: dict, text: str) -> bool:
        """Worth a `/tokenize`: a prompt long enough to hold a block, whose replica is to
        be chosen among several, at least one of which lists its tree."""
        return (
            method == "POST"
            and path.rstrip("/") in TOKENIZED_PATHS
            and not isinstance(body.get("session_id"), str)
            and len(text) >= MIN_TOKENIZED_CHARS
            and sum(r.up for r in self.replicas) > 1
            # no tree to match against (replicas without /cache_digest): the text record
            and any(r.up and r.digest is not None for r in self.replicas)
        )

    async def _prompt_keys(self, path: str, body: dict, headers) -> tuple[list[int], int] | None:
        """(the prompt's `prefix_hashes` as the engine keys its tree, its length in tokens):
        its token ids (from the least busy replica's `/tokenize`, with the client's own
        credentials, within TOKENIZE_TIMEOUT_S) under its `cache_salt`; None when they
        cannot be had (the text's record is used instead)."""
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return None  # the replica refuses it
        prompt = body.get("prompt") if path.rstrip("/") == "/v1/completions" else None
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # of several prompts, the first decides
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = prompt
        else:
            ask = self._tokenize_body(body, prompt)
            if ask is None:
                return None
            replica = min((r for r in self.replicas if r.up), key=lambda r: r.in_flight)
            auth = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in headers
                if k.lower() in (b"authorization", b"x-api-key")
            }
            try:
                answer = await self.client.post(
                    replica.url + "/tokenize", json=ask, headers=auth, timeout=TOKENIZE_TIMEOUT_S
                )
                ids = answer.json().get("tokens") if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                ids = None
            if not isinstance(ids, list):
                return None
        try:
            keys = salted_tokens(np.asarray(ids, dtype=np.int64), salt) if salt else ids
            return prefix_hashes(keys, DIGEST_BLOCK), len(ids)
        except (ValueError, TypeError, OverflowError):
            return None

    @staticmethod
    def _tokenize_body(body: dict, prompt) -> dict | None:
        """The `/tokenize` request that renders this prompt as its own endpoint does."""
        ask: dict = {"model": body.get("model")}
        if isinstance(prompt, str):
            ask["prompt"] = prompt
            return ask
        if not isinstance(body.get("messages"), list):
            return None
        ask["messages"] = body["messages"]
        for key in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
            if body.get(key) is not None:
                ask[key] = body[key]
        if body.get("tools") and body.get("tool_choice") != "none":
            ask["tools"] = body["tools"]  # the chat endpoint renders none under "none"
        return ask

    async def _proxy(self, index: int, scope, raw: bytes, send) -> None:
        replica = self.replicas[index]
        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = (
            replica.url
            + target.decode("latin-1")
            + (f"?{query.decode('latin-1')}" if query else "")
        )
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _REQUEST_DROPPED]
        started = streaming = False
        failure = None
        with anyio.CancelScope() as cut:
            replica.calls.add(cut)  # cut when the replica stays down (a hung process)
            try:
                upstream = await self._send(scope["method"], url, headers, raw)
                try:
                    kept = [
                        (k, v)
                        for k, v in upstream.headers.raw
                        if k.lower() not in _RESPONSE_DROPPED
                    ]
                    kind = upstream.headers.get("content-type", "")
                    streaming = kind.startswith("text/event-stream")
                    start = {"status": upstream.status_code, "headers": kept}
                    await send({"type": "http.response.start", **start})
                    started = True
                    head, seen = b"", False
                    async for chunk in upstream.aiter_raw():
                        if not seen and upstream.status_code == 200:
                            head = (head + chunk)[:8192]
                            seen = self._remember(index, scope, head, complete=False)
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if not seen and upstream.status_code == 200:
                        self._remember(index, scope, head, complete=True)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                finally:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await upstream.aclose()
            except httpx.HTTPError as exc:
                failure = f"replica {index} ({replica.url}) failed: {exc}"
            finally:
                replica.calls.discard(cut)
        if cut.cancelled_caught:
            failure = (
                f"replica {index} ({replica.url}) stopped answering: down for "
                f"{CUT_AFTER_S:.0f} s with this request in flight"
            )
        if failure is None:
            return
        _log.warning("replica failed a request", replica=replica.url, error=failure)
        if not started:
            await _error(send, 503, failure, "replica_unavailable")
        elif streaming:  # a stream cut mid-way: an error event, then the end
            event = json.dumps({"error": {"message": failure, "type": "replica_unavailable"}})
            tail = f"data: {event}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, method: str, url: str, headers, raw: bytes) -> httpx.Response:
        """The replica's response (streamed); a connection that went stale while idle is
        retried once on a fresh one (nothing was sent to the replica's app)."""
        for attempt in (1, 2):
            request = self.client.build_request(method, url, headers=headers, content=raw)
            try:
                return await self.client.send(request, stream=True)
            except httpx.RemoteProtocolError as exc:  # closed before any response byte
                if attempt == 2:
                    raise
                _log.info("stale connection, retrying once", url=url, error=str(exc))
        raise AssertionError("unreachable")

    def _remember(self, index: int, scope, head: bytes, complete: bool) -> bool:
        """Record a session opened or a response stored through this router, as soon as
        its id has passed; True once recorded (or nothing is to be)."""
        path = scope["path"].rstrip("/")
        if path == "/v1/sessions" and scope["method"] == "POST":
            if not complete:
                return False
            try:
                self.sessions.remember(json.loads(head)["id"], index)
            except (ValueError, KeyError, TypeError):
                pass
            return True
        if path == "/v1/responses" and scope["method"] == "POST":
            found = _RESPONSE_ID.search(head)
            if found:
                self.responses.remember(found.group(1).decode(), index)
            return bool(found) or complete
        return True

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
            up = (await self.probes.get(replica.url + "/health")).status_code == 200
        except httpx.HTTPError:
            up = False
        if up != replica.up:
            _log.warning("replica " + ("up" if up else "down"), replica=replica.url)
        replica.up = up
        now = time.monotonic()
        if up or replica.down_since is None:
            replica.down_since = None if up else now
        elif now - replica.down_since >= CUT_AFTER_S and replica.calls:
            # Down that long with requests in flight: a hung process (a dead one closes
            # their connections itself). Each ends with an error, not a wait forever.
            _log.warning("cutting requests to a hung replica", replica=replica.url)
            for cut in list(replica.calls):
                cut.cancel()
        if up:
            await self._fetch_digest(replica)
        else:  # a replica that comes back may be another process, with another tree
            replica.digest, replica.digest_version = None, -1

    async def _fetch_digest(self, replica: Replica) -> None:
        """The replica's tree digest, when it changed since the one held; then forget the
        prompts sent there whose requests ended before it was asked for."""
        asked = time.monotonic()
        try:
            answer = await self.probes.get(
                replica.url + "/cache_digest",
                params={"since": replica.digest_version},
                headers=self._auth,
            )
            if answer.status_code >= 500:
                return  # busy for now: the digest held stays until the next poll
            data = answer.json() if answer.status_code == 200 else None
            if not isinstance(data, dict) or data.get("block_tokens") != DIGEST_BLOCK:
                if replica.digest is not None or replica.digest_version == -1:
                    _log.warning(
                        "replica gives no cache digest: its own prompts' record is used",
                        replica=replica.url,
                        status=answer.status_code,
                    )
                replica.digest, replica.digest_version = None, -2
                return
            if not data.get("unchanged"):
                digest = unpack(base64.b64decode(data.get("hashes", "")))
                replica.dead_ends = unpack(base64.b64decode(data.get("dead") or ""))
                replica.digest = digest
                replica.digest_version = int(data["version"])
        except Exception as exc:  # noqa: BLE001 - the health poll must outlive any answer
            _log.info("cache digest not read", replica=replica.url, error=repr(exc)[:200])
            return  # the next poll asks again
        replica.sent.forget_ended(asked)

    async def _lifespan(self, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    tg.start_soon(self.poll_health)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    tg.cancel_scope.cancel()
                    break
        with anyio.CancelScope(shield=True):
            await self.client.aclose()
            await self.probes.aclose()
            await send({"type": "lifespan.shutdown.complete"})

    def metrics_text(self) -> str:
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

        registry = CollectorRegistry()
        labels = ["replica"]
        up = Gauge("kvactor_router_replica_up", "1 while it serves", labels, registry=registry)
        busy = Gauge("kvactor_router_replica_in_flight", "in flight", labels, registry=registry)
        routed = Counter(
            "kvactor_router_routed", "sent, by rule", [*labels, "reason"], registry=registry
        )
        digest = Gauge(
            "kvactor_router_replica_cached_prefixes",
            f"{DIGEST_BLOCK}-token prefixes its last tree digest listed",
            labels,
            registry=registry,
        )
        for r in self.replicas:
            digest.labels(r.url).set(len(r.digest or ()))
            up.labels(r.url).set(int(r.up))
            busy.labels(r.url).set(r.in_flight)
            for reason, n in r.routed.items():
                routed.labels(r.url, reason).inc(n)
        return generate_latest(registry).decode()


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body; None past `limit` bytes; _ClientLeft when the client leaves first."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send, status: int, body: bytes, kind: bytes = b"application/json") -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _error(send, status: int, message: str, code: str) -> None:
    body = {"error": {"message": message, "type": code, "code": code}}
    await _respond(send, status, json.dumps(body).encode())
