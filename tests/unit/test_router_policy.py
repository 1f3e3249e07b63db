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
    assert len(replica.texts.counts) == 6


# ---- the replicas' own trees (their digests) -------------------------------------------

from kvcore.prefix_digest import DIGEST_BLOCK, pack, prefix_hashes  # noqa: E402


def _keys(n: int, start: int = 0) -> list[int]:
    return prefix_hashes(list(range(start, start + n)), DIGEST_BLOCK)


def test_a_prompt_goes_to_the_replica_whose_tree_holds_most_of_it(router):
    held = _keys(4 * DIGEST_BLOCK)
    router.replicas[1].digest = set(held[:3])
    router.replicas[2].digest = set(held)  # all four blocks
    # the text record says replica 0 (a prompt sent there before): the trees win
    router.replicas[0].record(block_hashes("system prompt " * 50))
    body = {"prompt": "system prompt " * 50}
    assert router.choose("POST", "/v1/completions", body, tokens=held) == (2, 200, "cached_prefix")
    # half or less of the prompt cached anywhere: the least busy replica
    longer = _keys(9 * DIGEST_BLOCK)
    router.replicas[0].in_flight = 1
    assert router.choose("POST", "/v1/completions", body, tokens=longer) == (1, 200, "least_load")
    # the cached replica far busier than the least busy one: balance wins
    router.replicas[2].in_flight = BALANCE_ABS + 2
    assert router.choose("POST", "/v1/completions", body, tokens=held)[2] == "least_load"


def test_prompts_sent_count_until_a_digest_asked_after_they_ended():
    import math

    import actors.router as router_module

    replica = router_module.Replica("http://a", up=True)
    replica.digest = set()
    keys, other = _keys(3 * DIGEST_BLOCK), _keys(2 * DIGEST_BLOCK, start=10_000)
    entry = replica.sent.record(keys, math.inf)
    later = replica.sent.record(other, math.inf)
    assert replica.cached(keys) == 3  # in flight: not in any digest yet, but sent here
    later[0] = 10.0  # the second ended first, at t=10 ...
    replica.sent.forget_ended(20.0)  # ... and a digest asked at t=20 lists it (or not)
    assert replica.cached(other) == 0 and replica.cached(keys) == 3  # the first still runs
    entry[0] = 50.0  # it ended at t=50
    replica.sent.forget_ended(40.0)  # a digest asked before it ended
    assert replica.cached(keys) == 3
    replica.sent.forget_ended(60.0)  # one asked after: the tree decides
    assert replica.cached(keys) == 0 and not replica.sent.counts and not replica.sent.entries


def test_the_cached_share_counts_the_prompts_tokens_not_its_whole_blocks(router):
    held = _keys(2 * DIGEST_BLOCK)
    router.replicas[2].digest = set(held)
    body = {"prompt": "p" * 500}
    # two whole blocks of a 2.9-block prompt: 69% cached
    assert (
        router.choose("POST", "/v1/completions", body, [], held, int(2.9 * DIGEST_BLOCK))[2]
        == "cached_prefix"
    )
    # one of a 2.1-block prompt: 48%, not more than half
    one = held[:1] + _keys(DIGEST_BLOCK, start=500)
    router.replicas[2].digest = set(held[:1])
    assert (
        router.choose("POST", "/v1/completions", body, [], one, int(2.1 * DIGEST_BLOCK))[2]
        == "least_load"
    )


class _FakeReplica:
    """A replica's /tokenize and /cache_digest, answering as the engine does."""

    def __init__(self, tokens: list[int], digest: list[int], version: int = 7) -> None:
        self.tokens, self.digest, self.version = tokens, digest, version
        self.asked: list[tuple[str, dict, dict]] = []

    def __call__(self, request):
        import base64
        import json

        import httpx

        query = dict(request.url.params)
        self.asked.append((request.url.path, query, dict(request.headers)))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": self.tokens, "count": len(self.tokens)})
        if request.url.path == "/cache_digest":
            if query.get("since") == str(self.version):
                body = {"version": self.version, "block_tokens": DIGEST_BLOCK, "unchanged": True}
            else:
                raw = base64.b64encode(pack(self.digest)).decode()
                body = {"version": self.version, "block_tokens": DIGEST_BLOCK, "hashes": raw}
            return httpx.Response(200, text=json.dumps(body))
        return httpx.Response(404)


def test_the_prompt_keys_come_from_a_replica_tokenizer_under_the_salt(router):
    import anyio
    import httpx

    from kvcore.salt import salted_tokens

    ids = list(range(3 * DIGEST_BLOCK))
    fake = _FakeReplica(ids, [])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 300}], "tools": []}
    headers = [(b"authorization", b"Bearer k"), (b"cookie", b"no")]

    async def keys(path, body):
        return await router._prompt_keys(path, body, headers)

    expected = (prefix_hashes(ids, DIGEST_BLOCK), len(ids))
    assert anyio.run(keys, "/v1/chat/completions", chat) == expected
    path, _, sent_headers = fake.asked[-1]
    assert path == "/tokenize" and sent_headers["authorization"] == "Bearer k"
    assert "cookie" not in sent_headers  # only the client's credentials go along
    salted = anyio.run(keys, "/v1/completions", {"prompt": "x" * 300, "cache_salt": "t"})
    assert salted[0] == prefix_hashes(salted_tokens(ids, "t"), DIGEST_BLOCK) != expected[0]
    asked = len(fake.asked)
    assert anyio.run(keys, "/v1/completions", {"prompt": [ids]}) == expected
    assert len(fake.asked) == asked  # token ids given: nothing to ask
    assert anyio.run(keys, "/v1/completions", {"prompt": {"odd": 1}}) is None
    # a salt the replica would refuse: no keys (and no error here)
    assert anyio.run(keys, "/v1/completions", {"prompt": [ids], "cache_salt": 7}) is None


def test_the_tokenize_request_renders_the_prompt_as_its_endpoint_does():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = {"model": "m", "messages": [], "tools": tools, "add_generation_prompt": None}
    assert Router._tokenize_body(chat, None) == {"model": "m", "messages": [], "tools": tools}
    # tool_choice "none": the chat endpoint renders no tools, so neither does the router
    none = Router._tokenize_body({**chat, "tool_choice": "none"}, None)
    assert "tools" not in none and "add_generation_prompt" not in none
    assert Router._tokenize_body({"model": "m"}, None) is None


def test_the_digest_poll_reads_the_tree_once_per_version(router):
    import anyio
    import httpx

    held = _keys(2 * DIGEST_BLOCK)
    fake = _FakeReplica([], held)
    router.probes = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    replica = router.replicas[0]
    anyio.run(router._fetch_digest, replica)
    assert replica.digest == set(held) and replica.digest_version == 7
    fake.digest = []  # the replica would now answer differently, but its version is the same
    anyio.run(router._fetch_digest, replica)
    assert fake.asked[-1][1] == {"since": "7"} and replica.digest == set(held)
    fake.version = 8
    anyio.run(router._fetch_digest, replica)
    assert replica.digest == set()
    # a replica busy for now (5xx) keeps the digest held; one without a tree (404) drops it
    replica.digest = set(held)
    for status, kept in ((503, set(held)), (404, None)):

        def answer(request, status=status):
            return httpx.Response(status, json={"error": {"message": "x"}})

        router.probes = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        anyio.run(router._fetch_digest, replica)
        assert replica.digest == kept, status
    # an answer the router cannot read leaves the poll running (nothing raised)
    router.probes = httpx.AsyncClient(
        transport=httpx.MockTransport(
            lambda r: httpx.Response(
                200, text=f'{{"version": 1e999, "block_tokens": {DIGEST_BLOCK}, "hashes": ""}}'
            )
        )
    )
    anyio.run(router._fetch_digest, replica)


def test_a_prefix_whose_sliding_window_is_gone_is_not_counted_as_cached(router):
    """A replica resumes a prompt only where the window its next query reads still has its
    sliding KV (Gemma 3's sliding layers): the digest marks the prefixes past which none
    does, and the router counts a match only up to the last one it can resume after."""
    import anyio
    import httpx
    import msgspec
    import numpy as np

    from actors.radix_cache import RadixCacheActor

    radix = RadixCacheActor(page_size=16, sliding_window=128)
    history = np.arange(1000, 1000 + 6 * DIGEST_BLOCK)
    # an answer decoded past the window: its first 256 positions lost their sliding KV
    radix.tree.insert(history, np.arange(len(history)), alive=np.arange(len(history) // 16) >= 16)
    body = msgspec.json.decode(msgspec.json.encode(radix.digest(-1)))

    def answer(request):
        return httpx.Response(200, json=body)

    router.probes = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    replica = router.replicas[0]
    anyio.run(router._fetch_digest, replica)
    assert len(replica.digest) == 6
    whole = prefix_hashes(np.concatenate([history, np.arange(64)]), DIGEST_BLOCK)
    edited = prefix_hashes(np.concatenate([history[:320], np.arange(128)]), DIGEST_BLOCK)
    assert replica.cached(whole) == 6  # the window before position 384 is whole
    # five blocks match, but the window before position 320 reads dead pages, and so does
    # every earlier one: the replica would prefill this prompt from the start
    assert replica.cached(edited) == 0


# ---- a hung replica ---------------------------------------------------------------------


class _Hangs:
    """A replica that takes requests and never finishes them (a stopped process: its
    connections stay open): silent, or after a stream's first event."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming

    async def __call__(self, request):
        import anyio
        import httpx

        if not self.streaming:
            await anyio.sleep_forever()

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self):
                yield b'data: {"choices": []}\n\n'
                await anyio.sleep_forever()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Stream())


@pytest.mark.parametrize("streaming", [False, True])
def test_requests_to_a_replica_that_stays_down_end_with_an_error(router, monkeypatch, streaming):
    import anyio
    import httpx

    import actors.router as router_module

    monkeypatch.setattr(router_module, "CUT_AFTER_S", 0.2)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(_Hangs(streaming)))
    router.probes = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    replica = router.replicas[0]
    sent: list[dict] = []
    body = b'{"model": "m", "prompt": "hi", "stream": true}'
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    scope["query_string"] = b""

    async def receive():
        if not sent and not getattr(receive, "done", False):
            receive.done = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()

    async def send(message):
        sent.append(message)

    async def go():
        async with anyio.create_task_group() as tg:
            tg.start_soon(router, scope, receive, send)
            with anyio.fail_after(5):
                while not replica.calls or (streaming and len(sent) < 2):
                    await anyio.sleep(0.01)
            await router._check(replica)  # down: from now on
            assert replica.calls  # not cut at once (a slow health answer is not a hang)
            await anyio.sleep(0.3)
            await router._check(replica)  # down for longer than CUT_AFTER_S: cut
            with anyio.fail_after(5):
                while replica.in_flight:
                    await anyio.sleep(0.01)

    anyio.run(go)
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if streaming:
        assert sent[0]["status"] == 200
        assert b"stopped answering" in text and text.endswith(b"data: [DONE]\n\n")
    else:
        assert sent[0]["status"] == 503 and b"stopped answering" in text
    assert not replica.calls and replica.in_flight == 0


def test_prompts_are_tokenized_only_where_a_tree_can_be_matched(router):
    chat = {"messages": [{"role": "user", "content": "x" * 400}]}
    path = "/v1/chat/completions"
    assert not router._tokenizable("POST", path, chat, "x" * 400)  # no digest anywhere
    router.replicas[1].digest = set()
    assert router._tokenizable("POST", path, chat, "x" * 400)
    assert not router._tokenizable("POST", path, chat, "x" * 100)  # too short to hold a block
    assert not router._tokenizable("POST", path, {**chat, "session_id": "s"}, "x" * 400)
    assert not router._tokenizable("POST", "/v1/messages", chat, "x" * 400)
    router.replicas[0].up = router.replicas[2].up = False
    assert not router._tokenizable("POST", path, chat, "x" * 400)  # one replica: no choice


def test_replicas_on_cuda_get_gpus_of_their_own():
    """`serve --data-parallel-size N` on CUDA: replica i sees its own run of T GPUs
    (T = tensor_parallel_size), taken in the order CUDA_VISIBLE_DEVICES lists them."""
    from actors.app.data_parallel import replica_gpus

    assert replica_gpus(2, 1, ["0", "1"]) == ["0", "1"]
    assert replica_gpus(2, 2, ["3", "1", "0", "2", "4"]) == ["3,1", "0,2"]
    with pytest.raises(ValueError, match=r"2 replicas of 2 GPU\(s\) each need 4 GPUs; 3 visible"):
        replica_gpus(2, 2, ["0", "1", "2"])
    with pytest.raises(ValueError, match="need 2 GPUs; 0 visible"):
        replica_gpus(2, 1, [])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    from actors.app.data_parallel import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb,")
    assert visible_gpus() == ["GPU-aa", "GPU-bb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_replicas_asked_on_cuda_without_it_fail_before_any_starts(monkeypatch):
    import torch

    from actors.app.config import EngineConfig
    from actors.app.data_parallel import start_replicas

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    cfg = EngineConfig.load(parallel__data_parallel_size=2, model__device="cuda")
    with pytest.raises(SystemExit, match="--data-parallel-size 2: .*no CUDA device"):
        start_replicas(cfg, [])
    assert started == []
