"""Anthropic's Messages API through the official `anthropic` SDK, against a real server
process (the shared `server` fixture: the embedded Gemma 3 270M, fp32, API key on).

`messages.create` (text, usage, stop reasons max_tokens / end_turn / stop_sequence),
`messages.stream` (Anthropic's events in order; the same answer as `create`), a tool round
trip (a named tool forces a `tool_use` block whose input validates; its `tool_result` sent
back is answered in text), `messages.count_tokens` (the prompt `create` runs), and bad input
answered with the SDK's typed errors and Anthropic's error body. The engine holds no KV and
runs no request after every test.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.e2e.server_fixtures import MODEL_NAME, engine_figures, wait_idle

pytestmark = [pytest.mark.model]

COUNT = [{"role": "user", "content": "Write the numbers from 1 to 20, separated by commas."}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
# This SDK no longer takes sampling parameters as arguments; the server still reads them.
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120.0
    ) as c:
        yield c


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    figures, _ = wait_idle(server)
    assert figures['kvactor:kv_pages{state="held"}'] == 0


def _prompt_tokens(usage) -> int:
    """Anthropic counts cache reads apart: the prompt is input + cache-read tokens."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


# ---- create -----------------------------------------------------------------------------------


def test_create_answers_text_with_usage_and_stops_at_max_tokens(client):
    msg = client.messages.create(
        model=MODEL_NAME, max_tokens=8, messages=COUNT, extra_body=GREEDY, system="Be terse."
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL_NAME
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 8
    assert _prompt_tokens(msg.usage) > 10
    again = client.messages.create(
        model=MODEL_NAME, max_tokens=8, messages=COUNT, extra_body=GREEDY, system="Be terse."
    )
    assert again.content[0].text == msg.content[0].text
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache served the prompt
    assert _prompt_tokens(again.usage) == _prompt_tokens(msg.usage)


def test_create_ends_its_turn_and_follows_an_output_format(client):
    # A JSON schema (output_config.format, the constraint engine's) ends the answer early.
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": [3, 4, 5]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=MODEL_NAME,
        max_tokens=60,
        messages=[{"role": "user", "content": "What is 2 + 2? Reply in JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "end_turn", msg
    assert msg.usage.output_tokens < 60
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    whole = client.messages.create(
        model=MODEL_NAME, max_tokens=24, messages=COUNT, extra_body=GREEDY
    )
    text = whole.content[0].text
    stop = text.strip()[len(text.strip()) // 2 :][:3]
    assert len(stop) == 3, text
    msg = client.messages.create(
        model=MODEL_NAME, max_tokens=24, messages=COUNT, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


# ---- stream -----------------------------------------------------------------------------------


def test_stream_sends_anthropics_events_and_the_answer_create_gives(client):
    kw = dict(model=MODEL_NAME, max_tokens=12, messages=COUNT, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e.type for e in events if e.type in _RAW_EVENTS]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw[1] == "content_block_start" and raw[-3] == "content_block_stop"
    assert set(raw[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None
    assert _prompt_tokens(start.usage) == _prompt_tokens(whole.usage)
    texts = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(texts) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


_RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


# ---- tools ------------------------------------------------------------------------------------


def test_a_named_tool_is_called_and_its_result_answered(client):
    kw = dict(
        model=MODEL_NAME,
        max_tokens=100,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use", msg
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert len(calls) >= 1 and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])
    # Streamed: the same call, its input sent as input_json_delta.
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(
        e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events
    )
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (c.name, c.input) for c in calls
    ]
    assert final.stop_reason == "tool_use"

    follow_up = client.messages.create(
        model=MODEL_NAME,
        max_tokens=40,
        messages=[
            *ASK,
            {"role": "assistant", "content": msg.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": c.id, "content": "18 C, sunny"}
                    for c in calls
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert follow_up.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in follow_up.content] == ["text"] and follow_up.content[0].text.strip()
    # The call and its result are in the prompt.
    alone = client.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    assert _prompt_tokens(follow_up.usage) > alone.input_tokens + 20


# ---- count_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("with_tools", [False, True])
def test_count_tokens_is_the_prompt_create_runs(client, with_tools):
    kw = dict(model=MODEL_NAME, messages=ASK, system="You answer briefly.")
    if with_tools:
        kw.update(tools=[WEATHER], tool_choice={"type": "any"})
    counted = client.messages.count_tokens(**kw)
    msg = client.messages.create(max_tokens=1, extra_body=GREEDY, **kw)
    assert counted.input_tokens == _prompt_tokens(msg.usage) > 5


# ---- bad input --------------------------------------------------------------------------------


def _check_error(exc: anthropic.APIStatusError, kind: str, says: str) -> None:
    assert exc.body["type"] == "error", exc.body
    assert exc.body["error"]["type"] == kind
    assert says in exc.body["error"]["message"]


@pytest.mark.parametrize(
    "body, error, kind, says",
    [
        (
            {"model": MODEL_NAME, "messages": ASK},
            anthropic.BadRequestError,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "bot", "content": "x"}]},
            anthropic.BadRequestError,
            "invalid_request_error",
            "role",
        ),
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}],
            },
            anthropic.BadRequestError,
            "invalid_request_error",
            "type",
        ),
        (
            {"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": ASK},
            anthropic.NotFoundError,
            "not_found_error",
            "claude-sonnet-4-5",
        ),
    ],
    ids=["no_max_tokens", "bad_role", "bad_block", "unknown_model"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_gets_the_sdks_typed_error_and_changes_nothing(
    client, server, body, error, kind, says, stream
):
    before = engine_figures(server)
    with pytest.raises(error) as raised:
        client.post(
            "/v1/messages",
            body={**body, "stream": stream},
            cast_to=anthropic.types.Message,
        )
    _check_error(raised.value, kind, says)
    assert engine_figures(server) == before


def test_a_wrong_api_key_is_an_authentication_error(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            c.messages.create(model=MODEL_NAME, max_tokens=4, messages=ASK)
    _check_error(raised.value, "authentication_error", "API key")


def test_the_bearer_header_works_as_x_api_key_does(server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": ASK}
    resp = httpx.post(f"{server.base_url}/v1/messages", json=body, headers=server.auth)
    assert resp.status_code == 200, resp.text
    assert resp.json()["type"] == "message"
