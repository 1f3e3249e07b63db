"""The Responses API on the gateway's ASGI app, without an engine: a stand-in client plays
the engine's chunks and its sessions, so a stream that fails after its 200 (an `error`
event, then `response.failed`), refusals in OpenAI's shape, and where each stored
response's session goes (kept, handed on, given back, closed) are checked exactly. The
real model is in tests/e2e/test_responses_api.py."""

from __future__ import annotations

import json

import pytest

from actors.frontends.base import GenerationError
from actors.tokenizer.validation import ERR_INVALID_REQUEST
from tests.actors.test_anthropic_app import FakeEngine, _app, _events, _post
from transport.messages.sessions import SessionInfo

pytestmark = pytest.mark.anyio


class SessionEngine(FakeEngine):
    """FakeEngine with sessions: it records which are open."""

    def __init__(self, *args, refuse: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.open: set[str] = set()
        self.opened = 0
        self.refuse = refuse  # refuse every request before it starts

    async def open_session(self, ttl_s=0.0, max_tokens=0, key=""):
        self.opened += 1
        sid = f"s{self.opened}"
        self.open.add(sid)
        return self._info(sid)

    async def get_session(self, session_id, key=""):
        if session_id not in self.open:
            raise GenerationError("session_not_found", "no such session")
        return self._info(session_id)

    async def close_session(self, session_id, key=""):
        self.open.discard(session_id)
        return self._info(session_id, closed=True)

    def _info(self, sid: str, closed: bool = False) -> SessionInfo:
        return SessionInfo(
            session_id=sid,
            ttl_s=300,
            max_tokens=0,
            turns=0,
            tokens=0,
            held_tokens=0,
            idle_s=0,
            busy=False,
            closed=closed,
        )

    async def generate(self, params, *, on_accepted=None, **prompt):
        if self.refuse:
            raise GenerationError(ERR_INVALID_REQUEST, "temperature: out of range")
        async for chunk in super().generate(params, on_accepted=on_accepted, **prompt):
            yield chunk


def _req(**fields):
    return {"model": "m", "input": "Hi", "max_output_tokens": 8, **fields}


async def test_a_stream_that_fails_after_its_200_ends_with_error_then_response_failed():
    engine = SessionEngine(["a", "b", "c"], fail_after=2)
    app = _app(engine)
    status, raw = await _post(app, "/v1/responses", _req(stream=True))
    assert status == 200
    events = _events(raw)
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-2:] == ["error", "response.failed"]
    error, failed = events[-2][1], events[-1][1]
    assert "the runner died" in error["message"]
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    # Nothing was stored, and the session opened for it was closed.
    assert len(app.responses) == 0 and engine.open == set()


async def test_a_refused_request_is_an_openai_error_and_closes_its_session():
    engine = SessionEngine(refuse=True)
    app = _app(engine)
    status, raw = await _post(app, "/v1/responses", _req(), key=None)
    assert status == 401  # no key: refused before anything opens
    status, raw = await _post(app, "/v1/responses", _req())
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "temperature"
    assert engine.opened == 1 and engine.open == set() and len(app.responses) == 0


async def test_a_chain_hands_its_session_on_and_a_failed_follow_up_gives_it_back():
    engine = SessionEngine()
    app = _app(engine)
    status, raw = await _post(app, "/v1/responses", _req())
    assert status == 200, raw
    first = json.loads(raw)["id"]
    assert engine.open == {"s1"}
    status, raw = await _post(app, "/v1/responses", _req(previous_response_id=first))
    second = json.loads(raw)["id"]
    assert engine.open == {"s1"} and engine.opened == 1  # the same session, handed on
    turn = engine.calls[-1][1]
    assert turn["session_id"] == "s1"
    assert [m.role for m in turn["messages"]] == ["user", "assistant", "user"]

    engine.refuse = True
    status, _ = await _post(app, "/v1/responses", _req(previous_response_id=second))
    assert status == 400
    assert app.responses.get(second, "sk-test").session_id == "s1"  # given back
    engine.refuse = False

    status, raw = await _post(app, "/v1/responses/" + second, b"", key="sk-test")
    assert status == 405  # POST on an object path: GET and DELETE only
    assert engine.open == {"s1"}


async def test_deleting_a_stored_response_closes_its_session():
    engine = SessionEngine()
    app = _app(engine)
    _, raw = await _post(app, "/v1/responses", _req())
    rid = json.loads(raw)["id"]
    scope_path = f"/v1/responses/{rid}"
    status, raw = await _delete(app, scope_path)
    assert status == 200 and json.loads(raw) == {
        "id": rid,
        "object": "response.deleted",
        "deleted": True,
    }
    assert engine.open == set() and len(app.responses) == 0


async def _delete(app, path):
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": "DELETE",
        "path": path,
        "headers": [(b"authorization", b"Bearer sk-test")],
        "query_string": b"",
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])
