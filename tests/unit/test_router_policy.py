"""The data-parallel router's choice (actors/router.py), on replicas whose state the test
sets: sessions and Responses chains stay on their replica (or are refused, naming why),
a prompt goes where more than half of it was sent before unless that replica is far
busier, else to the least busy replica; replicas that are down are skipped."""

from __future__ import annotations

import pytest

from actors.router import BALANCE_ABS, NO_REPLICA, PREFIX_BLOCK, Router, block_hashes, prompt_text


@pytest.fixture
def router():
    r = Router(["http://a", "http://b", "http://c"])
    for replica in r.replicas:
        replica.up = True
    return r


def test_sessions_and_responses_stay_on_their_replica(router):
    router.sessions.remember("s1", 2)
    router.responses.remember("resp_9", 1)
    assert router.choose("POST", "/v1/completions", {"session_id": "s1"}) == (2, 200, "session")
    assert router.choose("POST", "/v1/sessions/s1/offload", {}) == (2, 200, "session")
    assert router.choose("POST", "/v1/responses", {"previous_response_id": "resp_9"}) == (
        1,
        200,
        "response",
    )
    assert router.choose("GET", "/v1/responses/resp_9", {}) == (1, 200, "response")
    index, status, why = router.choose("POST", "/v1/completions", {"session_id": "down-ish"})
    assert (index, status) == (None, 404) and "no session down-ish" in why
    router.replicas[2].up = False
    index, status, why = router.choose("POST", "/v1/completions", {"session_id": "s1"})
    assert (index, status) == (None, 503) and "is down" in why


def test_a_prompt_goes_where_most_of_it_was_sent(router):
    shared = "system prompt " * 50
    router.replicas[1].record(block_hashes(shared + "first question"))
    assert router.choose("POST", "/v1/completions", {"prompt": shared + "another"}) == (
        1,
        200,
        "prefix",
    )
    # a match of less than half the prompt is not enough: the least busy replica instead
    router.replicas[0].in_flight, router.replicas[1].in_flight = 1, 1
    other = shared[:130] + "something else entirely, and longer" * 8
    assert router.choose("POST", "/v1/completions", {"prompt": other}) == (2, 200, "least_load")
    # the cached replica far busier than the least busy one: balance wins
    router.replicas[1].in_flight = BALANCE_ABS + 2
    assert router.choose("POST", "/v1/completions", {"prompt": shared + "x"})[2] == "least_load"


def test_down_replicas_are_skipped(router):
    router.replicas[0].up = router.replicas[1].up = False
    assert router.choose("POST", "/v1/completions", {"prompt": "hi"}) == (2, 200, "least_load")
    router.replicas[2].up = False
    assert router.choose("POST", "/v1/completions", {"prompt": "hi"}) == (None, 503, NO_REPLICA)


def test_prompt_text_and_the_prefix_record():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert prompt_text(chat) == '[{"role": "user", "content": "hi"}]'
    assert prompt_text({"instructions": "be brief", "input": "x"}) == "be brief\nx"
    a, b = "x" * (3 * PREFIX_BLOCK), "x" * (2 * PREFIX_BLOCK) + "y" * PREFIX_BLOCK
    assert len(block_hashes(a)) == 3 and block_hashes(a)[:2] == block_hashes(b)[:2]
    assert block_hashes(a)[2] != block_hashes(b)[2] and block_hashes("short") == []


def test_the_record_forgets_the_oldest_prompts(monkeypatch):
    import actors.router as router_module

    monkeypatch.setattr(router_module, "TEXTS_PER_REPLICA", 2)
    replica = router_module.Replica("http://a")
    first, second, third = (block_hashes(c * 200) for c in "abc")
    for hashes in (first, second, third):
        replica.record(hashes)
    assert replica.matched(first) == 0  # forgotten
    mixed = block_hashes("b" * PREFIX_BLOCK + "c" * 136)  # second's first block, then not
    assert replica.matched(third) == 3 and replica.matched(mixed) == 1
    assert len(replica.prefixes) == 6
