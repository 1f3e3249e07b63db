"""The gateway's ASGI app without an engine (issue 26): deep JSON is a 400, a stream whose
rendering fails after the 200 still ends with an error event and [DONE], `cache_salt` maps
into GenerationParams, and streaming sessions are bound to the API key that opened them.

The app is driven directly (scope / receive / send). Generation tests use a stand-in client;
session tests use the real `EngineClient` over stand-in refs: the real `SessionsActor` logic
(its allocator calls answered in place) and a tokenizer that claims a turn as the real one
does (BeginTurn, refused when the session is unknown).
"""

from __future__ import annotations

import json

import anyio
import pytest

from actors.frontends.base import EngineClient, StreamRouter
from actors.frontends.http.app import GatewayApp
from actors.frontends.http.generation import CompletionRenderer
from actors.runtime import RemoteError
from actors.sessions import SessionsActor
from transport.messages.alloc import CloseSlots, CloseSlotsReply, OpenSlot, SlotStats
from transport.messages.control import Ack, ErrorReply
from transport.messages.engine import Accepted, GenerateRequest, OutputChunk
from transport.messages.sessions import BeginTurn

pytestmark = pytest.mark.anyio

KEY_A, KEY_B = "key-a", "key-b"


async def _request(app, method, path, body=b"", key=None, query=b""):
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    scope["query_string"] = query
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()

    async def send(message):
        sent.append(message)

    with anyio.fail_after(10):
        await app(scope, receive, send)
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:])


class FakeGenerateClient:
    """Accepts every request; each yields two chunks (the second final)."""

    def __init__(self):
        self.params = []

    async def generate(self, params, *, on_accepted=None, **prompt):
        self.params.append(params)
        on_accepted(None)
        yield OutputChunk(client_rid="r", text="a", token_ids=[1], prompt_tokens=3)
        yield OutputChunk(
            client_rid="r",
            text="b",
            token_ids=[2],
            finish_reason="stop",
            prompt_tokens=3,
            completion_tokens=2,
        )


async def _no_health():
    return {}


async def _no_stats():
    return None, None


def _app(client, api_key=None, **kw):
    return GatewayApp(
        client=client,
        model_names=["m"],
        context_len=1024,
        api_key=api_key,
        health=_no_health,
        stats=_no_stats,
        **kw,
    )


# ---- A: deep JSON, a stream that fails after its 200 -------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_json_nested_5000_deep_is_a_400_with_an_openai_error_body(path):
    deep = b'{"model": "m", "prompt": "x", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, body = await _request(_app(FakeGenerateClient()), "POST", path, deep)
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert "deep" in error["message"]


async def test_a_schema_string_nested_5000_deep_is_a_400():
    schema = "[" * 5000 + "]" * 5000
    body = {"model": "m", "prompt": "x", "guided_json": schema}
    status, out = await _request(
        _app(FakeGenerateClient()), "POST", "/v1/completions", json.dumps(body).encode()
    )
    assert status == 400, out
    assert json.loads(out)["error"]["param"] == "guided_json"


async def test_a_stream_whose_rendering_fails_after_the_200_ends_with_an_error_then_done(
    monkeypatch,
):
    def broken_delta(self, *args, **kwargs):
        raise RuntimeError("renderer bug")

    monkeypatch.setattr(CompletionRenderer, "delta", broken_delta)
    body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
    status, out = await _request(_app(FakeGenerateClient()), "POST", "/v1/completions", body)
    assert status == 200
    events = [e for e in out.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error"
    assert "RuntimeError" in error["message"]


# ---- C: cache_salt ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_cache_salt_reaches_the_generation_params(path):
    client = FakeGenerateClient()
    body = {"model": "m", "cache_salt": "tenant-1"}
    body.update(
        {"prompt": "x"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    status, out = await _request(_app(client), "POST", path, json.dumps(body).encode())
    assert status == 200, out
    assert client.params[0].cache_salt == "tenant-1"
    del body["cache_salt"]
    status, out = await _request(_app(client), "POST", path, json.dumps(body).encode())
    assert status == 200, out
    assert client.params[1].cache_salt == ""


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
async def test_a_bad_cache_salt_is_a_400_naming_it(salt):
    body = {"model": "m", "prompt": "x", "cache_salt": salt}
    client = FakeGenerateClient()
    status, out = await _request(_app(client), "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400, out
    assert json.loads(out)["error"]["param"] == "cache_salt"
    assert client.params == []


def test_validate_params_bounds_cache_salt():
    from transport.messages.engine import GenerationParams
    from transport.messages.params import InvalidParams, validate_params

    validate_params(GenerationParams(cache_salt="s" * 256))
    with pytest.raises(InvalidParams) as refused:
        validate_params(GenerationParams(cache_salt="s" * 257))
    assert refused.value.field == "cache_salt"
    with pytest.raises(InvalidParams) as refused:
        validate_params(GenerationParams(cache_salt=5))  # built in Python, not decoded
    assert refused.value.field == "cache_salt"


# ---- B: sessions bound to the API key that opened them ------------------------------------------


class _Log:
    def __init__(self):
        self.records = []

    def info(self, event, **kw):
        self.records.append((event, kw))

    warning = error = debug = info


class _Alloc:
    async def call(self, msg, expect=None):
        if isinstance(msg, OpenSlot):
            return Ack()
        if isinstance(msg, CloseSlots):
            return CloseSlotsReply(pages=0)
        return SlotStats(held_tokens=0)


class _Sessions(SessionsActor):
    """The real sessions logic, its allocator answered in place."""

    def __init__(self):
        super().__init__(context_len=1024)
        self.alloc = _Alloc()
        self._log = _Log()

    @property
    def log(self):
        return self._log


class _SessionsRef:
    def __init__(self, actor):
        self.actor = actor

    async def call(self, msg, expect=None):
        reply = await self.actor.handle(msg, None)
        if isinstance(reply, ErrorReply):
            raise RemoteError("sessions", reply)
        return reply


class _Tokenizer:
    """Claims a session turn as the real tokenizer does, then finishes the request."""

    def __init__(self, sessions, router):
        self.sessions = sessions
        self.router = router
        self.turns = []

    async def call(self, msg: GenerateRequest, expect=None):
        if msg.session_id:
            reply = self.sessions.actor._begin_turn(
                BeginTurn(session_id=msg.session_id, rid=1, prompt_tokens=1, max_new_tokens=1)
            )
            if not reply.ok:
                raise RemoteError("tokenizer", ErrorReply(code=reply.code, message=reply.message))
            self.turns.append(msg.session_id)
            self.sessions.actor.sessions[msg.session_id].busy_rid = None
        chunk = OutputChunk(
            client_rid=msg.client_rid, text="ok", token_ids=[1], finish_reason="stop"
        )
        self.router.deliver([chunk])
        return Accepted(client_rid=msg.client_rid, rid=1, prompt_tokens=1)

    async def send(self, msg):
        pass


def _session_app(api_key):
    actor = _Sessions()
    router = StreamRouter()
    sessions = _SessionsRef(actor)
    tokenizer = _Tokenizer(sessions, router)
    client = EngineClient(tokenizer, router, "gateway", sessions=sessions)
    return _app(client, api_key=api_key), actor, tokenizer


async def _open(app, key):
    status, body = await _request(app, "POST", "/v1/sessions", b"{}", key=key)
    assert status == 200, body
    return json.loads(body)["id"]


async def _turn(app, key, sid):
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1, "session_id": sid})
    return await _request(app, "POST", "/v1/completions", body.encode(), key=key)


async def test_a_session_is_invisible_under_another_api_key():
    app, actor, tokenizer = _session_app([KEY_A, KEY_B])
    sid = await _open(app, KEY_A)
    for method in ("GET", "DELETE"):
        status, body = await _request(app, method, f"/v1/sessions/{sid}", key=KEY_B)
        assert status == 404, body
        assert json.loads(body)["error"]["code"] == "session_not_found"
    status, body = await _turn(app, KEY_B, sid)
    assert status == 404, body
    assert tokenizer.turns == []
    # ... and fully usable under its own key
    status, body = await _request(app, "GET", f"/v1/sessions/{sid}", key=KEY_A)
    assert status == 200 and json.loads(body)["id"] == sid
    status, body = await _turn(app, KEY_A, sid)
    assert status == 200, body
    assert len(tokenizer.turns) == 1
    status, body = await _request(app, "DELETE", f"/v1/sessions/{sid}", key=KEY_A)
    assert status == 200 and json.loads(body)["closed"] is True


async def test_without_api_keys_anyone_may_use_a_session():
    app, actor, tokenizer = _session_app(None)
    sid = await _open(app, None)
    status, body = await _request(app, "GET", f"/v1/sessions/{sid}", key="anything")
    assert status == 200, body
    status, body = await _turn(app, None, sid)
    assert status == 200, body


async def test_session_ids_are_not_logged():
    app, actor, tokenizer = _session_app([KEY_A])
    sid = await _open(app, KEY_A)
    await _turn(app, KEY_A, sid)
    await _request(app, "DELETE", f"/v1/sessions/{sid}", key=KEY_A)
    logged = repr(actor.log.records)
    assert actor.log.records  # opened and closed are still logged...
    assert sid not in logged  # ... without the client's id
    for internal in tokenizer.turns:
        assert internal not in logged  # ... or the engine's


# ---- B on ZeroMQ: the endpoint's frames, without a socket ---------------------------------------


class _Endpoint:
    """A ZmqEndpointActor whose socket and task spawning are captured."""

    def __init__(self, api_key):
        from actors.frontends.zmq_endpoint import ZmqEndpointActor

        actor = ZmqEndpointActor("inproc://unused", api_key=api_key)
        sessions = _SessionsRef(_Sessions())
        actor.client = EngineClient(
            _Tokenizer(sessions, actor.router), actor.router, "zmq", sessions=sessions
        )
        self.sent, self.tasks = [], []
        actor._send = lambda identity, frame: self.sent.append(frame) or "ok"
        actor.spawn = lambda fn, *args: self.tasks.append(fn(*args))
        self.actor = actor
        self.tokenizer = actor.client.tokenizer

    async def frame(self, message):
        self.actor._on_frames([b"client", self.actor.codec.encode(message)])
        while self.tasks:
            await self.tasks.pop(0)
        return self.sent.pop()


async def test_on_zeromq_a_session_is_invisible_under_another_api_key():
    from transport.messages.client import ClientChunk, ClientError, ClientSession, ClientSubmit

    zmq = _Endpoint([KEY_A, KEY_B])
    opened = await zmq.frame(ClientSession(request_id="1", op="open", api_key=KEY_A))
    sid = opened.session_id
    for op in ("get", "close"):
        refused = await zmq.frame(
            ClientSession(request_id="2", op=op, session_id=sid, api_key=KEY_B)
        )
        assert isinstance(refused, ClientError) and refused.code == "session_not_found"
    turn = ClientSubmit(request_id="3", prompt="x", session_id=sid, api_key=KEY_B)
    refused = await zmq.frame(turn)
    assert isinstance(refused, ClientError) and refused.code == "session_not_found"
    assert zmq.tokenizer.turns == []
    got = await zmq.frame(ClientSession(request_id="4", op="get", session_id=sid, api_key=KEY_A))
    assert got.session_id == sid
    done = await zmq.frame(ClientSubmit(request_id="5", prompt="x", session_id=sid, api_key=KEY_A))
    assert isinstance(done, ClientChunk) and done.finish_reason == "stop"
    assert len(zmq.tokenizer.turns) == 1


async def test_http_and_zeromq_share_a_session_under_the_same_key():
    from actors.frontends.base import engine_session_id

    assert engine_session_id(KEY_A, "s1") == engine_session_id(KEY_A, "s1")
    assert engine_session_id(KEY_A, "s1") != engine_session_id(KEY_B, "s1")
    assert engine_session_id("", "s1") != "s1"  # the client's id never reaches the engine


# ---- /cache_digest: the prefix tree for a router -------------------------------------------


async def test_cache_digest_lists_the_trees_prefixes_behind_the_key():
    import base64

    import numpy as np

    from actors.radix_cache import RadixCacheActor
    from kvcore.prefix_digest import DIGEST_BLOCK, prefix_hashes, unpack

    radix = RadixCacheActor(page_size=16)
    tokens = np.arange(3 * DIGEST_BLOCK + 10)
    radix.tree.insert(tokens, np.arange(len(tokens)))

    async def digest(since):
        return radix.digest(since)

    app = _app(FakeGenerateClient(), api_key=KEY_A, digest=digest)
    assert (await _request(app, "GET", "/cache_digest"))[0] == 401
    status, body = await _request(app, "GET", "/cache_digest", key=KEY_A)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["block_tokens"] == DIGEST_BLOCK
    held = unpack(base64.b64decode(answer["hashes"]))
    assert held == set(prefix_hashes(tokens[: 3 * DIGEST_BLOCK]))
    since = f"since={answer['version']}".encode()
    status, body = await _request(app, "GET", "/cache_digest", key=KEY_A, query=since)
    assert json.loads(body)["unchanged"] is True and "hashes" not in json.loads(body)
    radix.tree.evict(1000)  # the tree changed: the same `since` gets the new content
    status, body = await _request(app, "GET", "/cache_digest", key=KEY_A, query=since)
    assert json.loads(body).get("hashes", "") == ""  # empty now
    # another process's tree starts at another version (1 in 2**20 alike)
    assert RadixCacheActor(16).digest(-1).version != RadixCacheActor(16).digest(-1).version
    status, body = await _request(app, "GET", "/cache_digest", key=KEY_A, query=b"since=x")
    assert status == 400 and json.loads(body)["error"]["param"] == "since"


async def test_cache_digest_marks_the_prefixes_whose_sliding_window_is_gone():
    import base64

    import numpy as np

    from actors.radix_cache import RadixCacheActor
    from kvcore.prefix_digest import DIGEST_BLOCK, prefix_hashes, unpack

    radix = RadixCacheActor(page_size=16, sliding_window=DIGEST_BLOCK)
    tokens = np.arange(4 * DIGEST_BLOCK)
    # the window freed the first two blocks' sliding KV
    radix.tree.insert(tokens, np.arange(len(tokens)), alive=np.arange(16) >= 8)

    async def digest(since):
        return radix.digest(since)

    app = _app(FakeGenerateClient(), api_key=KEY_A, digest=digest)
    status, body = await _request(app, "GET", "/cache_digest", key=KEY_A)
    answer = json.loads(body)
    chain = prefix_hashes(tokens)
    assert unpack(base64.b64decode(answer["hashes"])) == set(chain)
    # ends 64 and 128 read dead pages; 192 reads [129, 192), alive
    assert unpack(base64.b64decode(answer["dead"])) == set(chain[:2])
    # a digest cut short lists only dead ends among the prefixes it lists
    radix.tree.insert(tokens + 5000, np.arange(1000, 1000 + len(tokens)), alive=np.zeros(16, bool))
    radix.tree.digest = lambda limit=1: (chain[:1], True)
    cut = radix.digest(-1)
    assert cut.truncated and unpack(cut.dead) == set(chain[:1])


async def test_cache_digest_without_a_prefix_cache_is_a_404_naming_why():
    status, body = await _request(_app(FakeGenerateClient()), "GET", "/cache_digest")
    assert status == 404 and "kv.radix" in json.loads(body)["error"]["message"]


async def test_a_prefix_cache_that_does_not_answer_is_a_503_not_a_404():
    async def silent(since):
        return None

    app = _app(FakeGenerateClient(), digest=silent)
    status, body = await _request(app, "GET", "/cache_digest")
    assert status == 503 and "in time" in json.loads(body)["error"]["message"]
