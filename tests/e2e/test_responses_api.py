"""OpenAI's Responses API through the official `openai` client, against the real server.

Plain, streamed (the typed events, in order), with a function tool, with a structured
`text.format`, a `previous_response_id` chain whose second turn reports the cached input
its session served, GET and DELETE, the store's key binding, and bad input refused in
OpenAI's shape without changing anything.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.server_fixtures import MODEL_NAME, scrape_metrics, wait_idle

pytestmark = [pytest.mark.model]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120.0
    ) as c:
        yield c


@pytest.fixture
def made(client):
    """Ids of stored responses; deleted after the test, which releases their sessions."""
    ids: list[str] = []
    yield ids
    for rid in ids:
        client.responses.delete(rid)


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    figures, _ = wait_idle(server)
    assert figures['kvactor:kv_pages{state="held"}'] == 0


def test_plain_response_is_stored_and_deleted(client, server, made):
    resp = client.responses.create(
        model=MODEL_NAME,
        input="The capital of France is",
        instructions="Answer briefly.",
        max_output_tokens=6,
        temperature=0,
    )
    made.append(resp.id)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert resp.output_text == message.content[0].text and resp.output_text
    assert resp.instructions == "Answer briefly."

    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == resp.output_text
    # Another key cannot see it (a 404, as for an id that never existed).
    other = httpx.get(
        f"{server.base_url}/v1/responses/{resp.id}", headers={"x-api-key": "not-the-key"}
    )
    assert other.status_code == 401
    deleted = client.responses.delete(resp.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    made.remove(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_stream_sends_the_typed_events_in_order(client, made):
    whole = client.responses.create(
        model=MODEL_NAME, input="Count: 1, 2, 3,", max_output_tokens=8, temperature=0, store=False
    )
    events = list(
        client.responses.create(
            model=MODEL_NAME,
            input="Count: 1, 2, 3,",
            max_output_tokens=8,
            temperature=0,
            stream=True,
            store=False,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    with pytest.raises(openai.NotFoundError):  # store=False: nothing kept
        client.responses.retrieve(final.id)


def test_named_function_tool_makes_a_call_and_takes_its_output(client, made):
    first = client.responses.create(
        model=MODEL_NAME,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    made.append(first.id)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert first.status == "completed"

    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21C"}
        ],
        tools=[WEATHER],  # the same tools: the prompt extends the first one
        max_output_tokens=5,
        temperature=0,
    )
    made.append(second.id)
    assert second.output and second.previous_response_id == first.id
    # The follow-up ran on the first turn's KV.
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2


def test_streamed_function_call_events(client):
    events = list(
        client.responses.create(
            model=MODEL_NAME,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=40,
            temperature=0,
            stream=True,
            store=False,
        )
    )
    kinds = [e.type for e in events]
    at = kinds.index("response.function_call_arguments.delta")
    assert kinds[at - 1] == "response.output_item.added"
    assert kinds[at + 1 : at + 3] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    done = events[at + 1]
    assert done.name == "get_weather" and "city" in json.loads(done.arguments)
    assert kinds[-1] == "response.completed"
    [call] = [i for i in events[-1].response.output if i.type == "function_call"]
    assert call.arguments == done.arguments


def test_structured_text_format(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=MODEL_NAME,
        input="Reply in JSON: what is 2+2?",
        text={"format": {"type": "json_schema", "name": "reply", "schema": schema}},
        max_output_tokens=40,
        temperature=0,
        store=False,
    )
    assert resp.status == "completed"
    assert isinstance(json.loads(resp.output_text)["answer"], str)


def test_previous_response_chain_reports_cached_input(client, made):
    first = client.responses.create(
        model=MODEL_NAME,
        input="Here is a story about a fox who lived in a quiet forest near the river.",
        max_output_tokens=8,
        temperature=0,
    )
    made.append(first.id)
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=4,
        temperature=0,
    )
    made.append(second.id)
    cached = second.usage.input_tokens_details.cached_tokens
    # The whole first prompt came from the session (its output too, as far as the template
    # renders it the way it was generated).
    assert cached >= first.usage.input_tokens - 1
    assert second.usage.input_tokens > first.usage.input_tokens + 8


def test_bad_input_gets_openai_errors_and_changes_nothing(client, server):
    series = 'kvactor:requests_total{endpoint="responses",outcome="error"}'
    before = scrape_metrics(server)[series]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL_NAME, input="hi", previous_response_id="resp_missing", max_output_tokens=2
        )
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL_NAME,
            input=[{"type": "message", "role": "user", "content": [{"type": "input_image"}]}],
        )
    assert err.value.body["code"] == "unsupported_content"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="hi", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    assert scrape_metrics(server)[series] == before + 5  # counted under its endpoint


def test_stored_responses_hold_a_bounded_number_of_sessions(client, server, made):
    """Every stored response keeps its KV in a session, but together they hold at most
    server.responses_max_sessions (4): the least recently stored gives its up (closed) and
    its follow-up runs on the prefix cache instead."""
    before = scrape_metrics(server)["kvactor:sessions_open"]
    for i in range(6):
        resp = client.responses.create(
            model=MODEL_NAME, input=f"Item {i}:", max_output_tokens=2, temperature=0
        )
        made.append(resp.id)
    assert scrape_metrics(server)["kvactor:sessions_open"] == before + 4
    # The oldest lost its session, not its conversation: a follow-up still works.
    follow = client.responses.create(
        model=MODEL_NAME, previous_response_id=made[0], input="More.", max_output_tokens=2
    )
    made.append(follow.id)
    assert follow.previous_response_id == made[0] and follow.usage.input_tokens > 0


def test_two_follow_ups_of_one_response_both_run(client, made):
    """The first follow-up continues the session; the second (a fork) gets a session of its
    own and prefills again: the KV went on with the chain's latest turn."""
    story = "A long story begins here, in a town by the sea where the boats came in at dawn "
    first = client.responses.create(
        model=MODEL_NAME, input=story * 3, max_output_tokens=4, temperature=0
    )
    made.append(first.id)
    cached = []
    for text in ("Then?", "And after?"):
        resp = client.responses.create(
            model=MODEL_NAME, previous_response_id=first.id, input=text, max_output_tokens=2
        )
        made.append(resp.id)
        assert resp.status == "incomplete" and resp.output_text
        cached.append(resp.usage.input_tokens_details.cached_tokens)
    assert cached[0] >= first.usage.input_tokens - 1
    assert cached[1] < first.usage.input_tokens


def test_a_bad_function_name_is_a_400(client):
    tool = {**WEATHER, "name": "not a valid name!"}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="hi", tools=[tool])
    assert err.value.body["param"] == "tools[0].name"
