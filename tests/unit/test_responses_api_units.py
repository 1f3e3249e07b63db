"""The Responses API's pure parts: the bounded, key-bound store and the input items'
translation to chat messages."""

from __future__ import annotations

import pytest

from actors.frontends.http.errors import ApiError
from actors.frontends.http.responses import ResponseStore, StoredResponse, input_messages
from actors.frontends.http.responses_schemas import ResponseObject


def _item(rid: str, key: str = "k", session: str | None = None) -> StoredResponse:
    body = ResponseObject(id=rid, created_at=0, model="m", status="completed", output=[])
    return StoredResponse(id=rid, key=key, body=body, conversation=[], session_id=session)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_keeps_at_most_max_count_dropping_the_oldest():
    store = ResponseStore(max_count=2, ttl_s=100)
    store.put(_item("a", session="s1"))
    store.put(_item("b"))
    assert store.take_retired() == []
    store.put(_item("c"))
    assert store.get("a", "k") is None and store.get("c", "k") is not None
    assert len(store) == 2
    assert store.take_retired() == [("k", "s1")]  # the caller closes it
    assert store.take_retired() == []


def test_store_forgets_responses_older_than_ttl_and_retires_their_sessions():
    clock = Clock()
    store = ResponseStore(max_count=10, ttl_s=5, clock=clock)
    store.put(_item("a", session="s1"))
    clock.now = 3
    store.put(_item("b"))
    clock.now = 6
    assert store.get("a", "k") is None  # 6 s old
    assert store.get("b", "k") is not None  # 3 s old
    assert store.take_retired() == [("k", "s1")]


def test_store_holds_at_most_max_sessions_the_oldest_gives_its_up():
    store = ResponseStore(max_count=10, ttl_s=100, max_sessions=2)
    for i in range(3):
        store.put(_item(f"r{i}", session=f"s{i}"))
    assert store.take_retired() == [("k", "s0")]
    assert store.get("r0", "k").session_id is None  # still stored, without its KV
    assert [store.get(f"r{i}", "k").session_id for i in (1, 2)] == ["s1", "s2"]


def test_store_shows_a_response_only_to_the_key_that_made_it():
    store = ResponseStore()
    store.put(_item("a", key="alice", session="s"))
    assert store.get("a", "bob") is None and store.take("a", "bob") is None
    item = store.get("a", "alice")
    assert store.holds(item)
    assert store.take("a", "alice").id == "a"
    assert store.get("a", "alice") is None and not store.holds(item)
    assert store.take_retired() == [("alice", "s")]


def test_input_items_become_chat_messages():
    msgs = input_messages(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
    )
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert [c.id for c in msgs[1].tool_calls] == ["c1", "c2"]  # one assistant turn
    assert msgs[2].tool_call_id == "c1" and msgs[2].content == "sunny"
    assert input_messages("hi")[0].content == "hi"


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([], "input"),
        ([{"role": "robot", "content": "x"}], "input[0].role"),
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"type": "function_call", "name": "w", "arguments": "{}"}], "input[0].call_id"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input[0]"),
    ],
)
def test_bad_input_items_name_the_item(items, param):
    with pytest.raises(ApiError) as err:
        input_messages(items)
    assert err.value.status == 400 and err.value.detail.param == param
