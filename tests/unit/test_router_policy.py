"""The data-parallel router's choice (actors/router.py), on replicas whose state the test
sets: sessions and Responses chains stay on their replica (or are refused, naming why),
a prompt goes where more than half of it was sent before unless that replica is far
busier, else to the least busy replica; replicas that are down are skipped."""

from __future__ import annotations

import pytest

from actors.router import BALANCE_ABS, Router, _common_prefix, prompt_text


@pytest.fixture
def router():
    r = Router(["http://a", "http://b", "http://c"])
    for replica in r.replicas:
        replica.up = True
    return r


def test_sessions_and_responses_stay_on_their_replica(router):
    router.sessions.remember("s1", 2)
    router.responses.remember("resp_9", 1)
    assert router.choose("POST", "/v1/completions", {"session_id": "s1"}) == (2, "session")
    assert router.choose("POST", "/v1/sessions/s1/offload", {}) == (2, "session")
    assert router.choose("POST", "/v1/responses", {"previous_response_id": "resp_9"}) == (
        1,
        "response",
    )
    assert router.choose("GET", "/v1/responses/resp_9", {}) == (1, "response")
    index, why = router.choose("POST", "/v1/completions", {"session_id": "nope"})
    assert index is None and "no session nope" in why
    router.replicas[2].up = False
    index, why = router.choose("POST", "/v1/completions", {"session_id": "s1"})
    assert index is None and "down" in why


def test_a_prompt_goes_where_most_of_it_was_sent(router):
    shared = "system prompt " * 50
    router.replicas[1].texts.append(shared + "first question")
    assert router.choose("POST", "/v1/completions", {"prompt": shared + "another"}) == (
        1,
        "prefix",
    )
    # a match of less than half the prompt is not enough: the least busy replica instead
    router.replicas[0].in_flight, router.replicas[1].in_flight = 1, 1
    other = "system prompt " + "something else entirely, and longer" * 2
    assert router.choose("POST", "/v1/completions", {"prompt": other}) == (
        2,
        "least_load",
    )
    # the cached replica far busier than the least busy one: balance wins
    router.replicas[1].in_flight = BALANCE_ABS + 2
    assert router.choose("POST", "/v1/completions", {"prompt": shared + "x"})[1] == "least_load"


def test_down_replicas_are_skipped(router):
    router.replicas[0].up = router.replicas[1].up = False
    assert router.choose("POST", "/v1/completions", {"prompt": "hi"}) == (2, "least_load")
    router.replicas[2].up = False
    assert router.choose("POST", "/v1/completions", {"prompt": "hi"}) == (
        None,
        "no replica is serving",
    )


def test_prompt_text_and_common_prefix():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert prompt_text(chat) == '[{"role": "user", "content": "hi"}]'
    assert prompt_text({"instructions": "be brief", "input": "x"}) == "be brief\nx"
    assert _common_prefix("abcdef", "abcxyz") == 3
    assert _common_prefix("abc", "abc") == 3
    assert _common_prefix("", "abc") == 0
