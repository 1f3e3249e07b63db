"""Anthropic's Messages API on the gateway's ASGI app, without an engine: a stand-in client
plays the engine's chunks, so the translation (system, merged turns, tool_use / tool_result,
tool_choice), the answer's blocks and stop reasons, the streamed events (whole and streamed
agree), Anthropic-shaped errors (nothing reaches the engine) and a stream that fails after
its 200 (`event: error`) are checked exactly. The real model is in
tests/e2e/test_anthropic_api.py.
"""

from __future__ import annotations

import json

import anthropic
import anyio
import pytest

from actors.frontends.base import GenerationError
from actors.frontends.http.anthropic import _Blocks
from actors.frontends.http.anthropic_schemas import TextOut, ThinkingOut
from actors.frontends.http.app import GatewayApp
from actors.frontends.http.output_parts import Parts
from actors.tokenizer.validation import ERR_INVALID_REQUEST
from transport.messages.engine import Accepted, OutputChunk, TokenizeReply

pytestmark = pytest.mark.anyio

KEY = "sk-test"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


class FakeEngine:
    """Answers each request with `texts` as chunks (the last one final), or fails after
    `fail_after` chunks; records what it was asked."""

    def __init__(
        self,
        texts=("Hel", "lo"),
        *,
        finish="stop",
        stop_matched=None,
        prompt_tokens=7,
        cached=3,
        fail_after=None,
    ):
        self.texts = list(texts)
        self.finish = finish
        self.stop_matched = stop_matched
        self.prompt_tokens = prompt_tokens
        self.cached = cached
        self.fail_after = fail_after
        self.calls: list[tuple] = []
        self.tokenized: list[dict] = []

    async def generate(self, params, *, on_accepted=None, **prompt):
        self.calls.append((params, prompt))
        on_accepted(Accepted(client_rid="r", rid=1, prompt_tokens=self.prompt_tokens))
        for i, text in enumerate(self.texts):
            if self.fail_after == i:
                raise GenerationError("engine_error", "the runner died")
            last = i == len(self.texts) - 1
            yield OutputChunk(
                client_rid="r",
                text=text,
                token_ids=[i],
                finish_reason=self.finish if last else None,
                stop_matched=self.stop_matched if last else None,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=i + 1,
                cached_tokens=self.cached,
            )

    async def tokenize(self, **request):
        self.tokenized.append(request)
        return TokenizeReply(tokens=list(range(self.prompt_tokens)))


async def _no_health():
    return {}


async def _no_stats():
    return None, None


def _app(engine):
    return GatewayApp(
        client=engine,
        model_names=["m"],
        context_len=1024,
        api_key=KEY,
        health=_no_health,
        stats=_no_stats,
        tool_call_parser="hermes",
    )


async def _post(app, path, body, key=KEY):
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"x-api-key", key.encode()))
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    scope["query_string"] = b""
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            return {"type": "http.request", "body": data, "more_body": False}
        await anyio.sleep_forever()

    async def send(message):
        sent.append(message)

    with anyio.fail_after(10):
        await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _events(raw: bytes) -> list[tuple[str, dict]]:
    """The named events of an SSE body (comments skipped)."""
    out = []
    for frame in raw.decode().split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def _blocks_of(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks a client assembles from a stream."""
    blocks: list[dict] = []
    for name, data in events:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                block.setdefault("json", "")
                block["json"] += delta["partial_json"]
    for block in blocks:
        if "json" in block:
            block["input"] = json.loads(block.pop("json") or "{}")
    return blocks


def _req(**fields):
    return {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hi"}],
        **fields,
    }


# ---- answers ----------------------------------------------------------------------------------


async def test_a_text_answer_is_one_text_block_with_anthropic_usage():
    engine = FakeEngine()
    status, body = await _post(_app(engine), "/v1/messages", _req())
    assert status == 200, body
    msg = json.loads(body)
    anthropic.types.Message.model_validate(msg)  # the SDK's own model of the answer
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == "m"
    assert msg["id"].startswith("msg_")
    assert msg["content"] == [{"type": "text", "text": "Hello"}]
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    # input_tokens are the prompt tokens not read from the cache (as Anthropic counts)
    assert msg["usage"] == {
        "input_tokens": 4,
        "output_tokens": 2,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
    }


@pytest.mark.parametrize(
    "finish, matched, reason, sequence",
    [
        ("length", None, "max_tokens", None),
        ("stop", "END", "stop_sequence", "END"),
        ("stop", 1, "end_turn", None),  # a stop token id is the end of the turn
    ],
)
async def test_stop_reasons(finish, matched, reason, sequence):
    engine = FakeEngine(finish=finish, stop_matched=matched)
    status, body = await _post(_app(engine), "/v1/messages", _req(stop_sequences=["END"]))
    msg = json.loads(body)
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, sequence)
    assert engine.calls[0][0].stop == ["END"]


async def test_the_request_becomes_the_chat_request_it_means():
    engine = FakeEngine()
    body = _req(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "user", "content": [{"type": "text", "text": "Now."}]},  # merged
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},  # dropped
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "Thanks!", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        metadata={"user_id": "u"},
        max_tokens=5000,  # past the room the prompt leaves: a cap, not a 400
    )
    status, out = await _post(_app(engine), "/v1/messages", body)
    assert status == 200, out
    params, prompt = engine.calls[0]
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 20)
    assert params.max_tokens == 5000 and not params.max_tokens_strict
    msgs = [(m.role, m.content, m.tool_calls, m.tool_call_id) for m in prompt["messages"]]
    text = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    assert msgs[0] == ("system", text, None, None)
    assert msgs[1][:2] == (
        "user",
        [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Now."}],
    )
    assert msgs[2][0] == "assistant" and msgs[2][1] is None
    assert msgs[2][2][0]["id"] == "toolu_1" and msgs[2][2][0]["function"]["arguments"] == "{}"
    assert msgs[3] == ("tool", "sunny", None, "toolu_1")
    assert msgs[4] == ("user", "Thanks!", None, None)
    assert [t["function"]["name"] for t in prompt["tools"]] == ["get_weather"]
    assert prompt["add_generation_prompt"] and not prompt["continue_final_message"]


async def test_a_final_assistant_turn_is_continued():
    engine = FakeEngine()
    messages = [
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "1, 2,"},
    ]
    status, _ = await _post(_app(engine), "/v1/messages", _req(messages=messages))
    assert status == 200
    prompt = engine.calls[0][1]
    assert prompt["continue_final_message"] and not prompt["add_generation_prompt"]


@pytest.mark.parametrize(
    "choice, constrained",
    [
        ({"type": "any"}, True),
        ({"type": "tool", "name": "get_weather"}, True),
        ({"type": "none"}, False),
    ],
)
async def test_tool_choice_maps_to_the_constraint_engine(choice, constrained):
    engine = FakeEngine()
    status, out = await _post(
        _app(engine), "/v1/messages", _req(tools=[WEATHER], tool_choice=choice)
    )
    assert status == 200, out
    params, prompt = engine.calls[0]
    assert (params.constraint is not None) == constrained
    assert ("tools" in prompt) == constrained


async def test_a_tool_call_is_a_tool_use_block_whole_and_streamed_alike():
    texts = ["Let me check.", "\n", *[CALL[i : i + 7] for i in range(0, len(CALL), 7)]]
    whole_engine, stream_engine = FakeEngine(texts), FakeEngine(texts)
    status, body = await _post(_app(whole_engine), "/v1/messages", _req(tools=[WEATHER]))
    msg = json.loads(body)
    assert msg["stop_reason"] == "tool_use"
    text, call = msg["content"]
    assert text == {"type": "text", "text": "Let me check."}  # the parser takes the blank
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})

    status, raw = await _post(
        _app(stream_engine), "/v1/messages", _req(tools=[WEATHER], stream=True)
    )
    assert status == 200
    events = _events(raw)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 4 and start["usage"]["cache_read_input_tokens"] == 3
    streamed = _blocks_of(events)
    streamed[1]["id"] = call["id"]  # ids are fresh per request
    assert streamed == msg["content"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(texts)
    assert names.count("content_block_start") == names.count("content_block_stop") == 2


async def test_whitespace_alone_before_a_call_is_no_block():
    engine = FakeEngine(["\n\n", CALL, "\n"])
    status, body = await _post(_app(engine), "/v1/messages", _req(tools=[WEATHER]))
    assert [b["type"] for b in json.loads(body)["content"]] == ["tool_use"]


@pytest.mark.parametrize("stream", [False, True])
async def test_with_a_reasoning_parser_thinking_is_a_thinking_block(stream):
    pytest.importorskip("actors.reasoning")
    texts = ["<think>", "Two plus", " two.", "</think>", "\n\n", "It is 4."]
    app = GatewayApp(
        client=FakeEngine(texts),
        model_names=["m"],
        context_len=1024,
        api_key=KEY,
        health=_no_health,
        stats=_no_stats,
        reasoning_parser="qwen3",
    )
    status, out = await _post(app, "/v1/messages", _req(stream=stream))
    assert status == 200, out
    if stream:
        events = _events(out)
        assert ("content_block_delta", "thinking_delta") in [
            (name, data["delta"].get("type")) for name, data in events if "delta" in data
        ]
        blocks = _blocks_of(events)
    else:
        blocks = anthropic.types.Message.model_validate(json.loads(out)).model_dump()["content"]
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in blocks] == [
        ("thinking", "Two plus two."),
        ("text", "It is 4."),
    ]
    assert blocks[0]["signature"] == ""


def test_thinking_then_text_blocks_and_their_events():
    blocks = _Blocks()
    blocks.add(Parts(reasoning="Let me think"))
    blocks.add(Parts(reasoning=" more.", content="\n\n"))
    blocks.add(Parts(content="Answer."))
    blocks.finish()
    assert blocks.blocks == [ThinkingOut("Let me think more."), TextOut("\n\nAnswer.")]
    events = blocks.take_events()
    assert [name for name, _ in events] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    assert events[0][1]["content_block"] == ThinkingOut("", "")
    assert events[1][1]["delta"] == {"type": "thinking_delta", "thinking": "Let me think"}
    assert events[5][1]["delta"] == {"type": "text_delta", "text": "\n\nAnswer."}


# ---- errors -----------------------------------------------------------------------------------


def _anthropic_error(body: bytes, kind: str) -> str:
    error = json.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    return error["error"]["message"]


@pytest.mark.parametrize(
    "body, status, kind, says",
    [
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (_req(messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error", "role"),
        (
            _req(messages=[{"role": "user", "content": [{"type": "video"}]}]),
            400,
            "invalid_request_error",
            "type",
        ),
        (
            _req(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            400,
            "invalid_request_error",
            "image blocks are not supported",
        ),
        (
            _req(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ]
            ),
            400,
            "invalid_request_error",
            "a user turn cannot hold a tool_use block",
        ),
        (
            _req(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
            400,
            "invalid_request_error",
            "client tools",
        ),
        (_req(tool_choice={"type": "tool"}), 400, "invalid_request_error", "tool_choice"),
        (
            _req(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
            400,
            "invalid_request_error",
            "nope",
        ),
        (_req(mcp_servers=[{"type": "url"}]), 400, "invalid_request_error", "mcp_servers"),
        (_req(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
        (_req(model="claude-sonnet-4-5"), 404, "not_found_error", "claude-sonnet-4-5"),
        (b"{not json", 400, "invalid_request_error", "JSON"),
    ],
)
async def test_bad_requests_get_anthropic_errors_and_reach_no_engine(body, status, kind, says):
    engine = FakeEngine()
    got, out = await _post(_app(engine), "/v1/messages", body)
    assert got == status, out
    assert says in _anthropic_error(out, kind)
    assert engine.calls == []


@pytest.mark.parametrize("key", [None, "wrong"])
async def test_a_missing_or_wrong_api_key_is_an_anthropic_401(key):
    engine = FakeEngine()
    status, out = await _post(_app(engine), "/v1/messages", _req(), key=key)
    assert status == 401
    _anthropic_error(out, "authentication_error")
    assert engine.calls == []


async def test_a_refusal_by_the_engine_is_an_anthropic_400_even_when_streamed():
    class Refusing(FakeEngine):
        async def generate(self, params, *, on_accepted=None, **prompt):
            raise GenerationError(ERR_INVALID_REQUEST, "temperature: must be at most 2")
            yield  # an async generator

    status, out = await _post(_app(Refusing()), "/v1/messages", _req(stream=True))
    assert status == 400
    assert "temperature" in _anthropic_error(out, "invalid_request_error")


async def test_a_stream_that_fails_after_its_200_ends_with_an_error_event():
    engine = FakeEngine(["a", "b", "c"], fail_after=2)
    status, raw = await _post(_app(engine), "/v1/messages", _req(stream=True))
    assert status == 200
    events = _events(raw)
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"]["type"] == "api_error" and "the runner died" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]


# ---- count_tokens -----------------------------------------------------------------------------


async def test_count_tokens_renders_the_prompt_a_message_request_would():
    engine = FakeEngine(prompt_tokens=11)
    body = _req(system="Be brief.", tools=[WEATHER])
    del body["max_tokens"]
    status, out = await _post(_app(engine), "/v1/messages/count_tokens", body)
    assert status == 200, out
    assert json.loads(out) == {"input_tokens": 11}
    asked = engine.tokenized[0]
    assert [m.role for m in asked["messages"]] == ["system", "user"]
    assert [t["function"]["name"] for t in asked["tools"]] == ["get_weather"]
    assert asked["add_generation_prompt"] and not asked["continue_final_message"]
    assert engine.calls == []


async def test_count_tokens_refuses_what_messages_refuses():
    engine = FakeEngine()
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "document"}]}]}
    status, out = await _post(_app(engine), "/v1/messages/count_tokens", body)
    assert status == 400
    assert "document" in _anthropic_error(out, "invalid_request_error")
    assert engine.tokenized == []
