"""Streaming sessions on the real model: the engine (HF parity, prefill counts, aborts), then
the HTTP API through the official `openai` client and the ZeroMQ SDK against a real server.
"""

from __future__ import annotations

import contextlib

import anyio
import httpx
import openai
import pytest

from actors.app.serving import ServingEngine
from actors.frontends.base import GenerationError
from tests.e2e.engine_fixtures import natural_text, small_config
from tests.e2e.server_fixtures import MODEL_NAME, scrape_metrics, wait_idle
from tests.e2e.test_engine_e2e import hf_greedy
from transport.client import KvactorClient, KvactorError
from transport.messages.engine import ChatMessage, GenerationParams

pytestmark = [pytest.mark.model]

QUESTIONS = [
    "Name a colour.",
    "Why is the sky blue? One sentence.",
    "Say it again, shorter.",
    "Now count to five.",
    "Thanks. Say goodbye.",
]


@pytest.fixture(scope="module")
async def engine(anyio_backend):
    # A pool of 96 pages of 16 tokens: three 500-token requests evict the whole tree.
    async with ServingEngine(small_config(kv__num_pages=96)) as eng:
        yield eng


async def settled(eng: ServingEngine):
    """Idle: no request left and no disk-tier file being written beside the steps."""
    for _ in range(200):
        s = await eng.scheduler_stats()
        if s.waiting == s.running == s.prefilling == 0:
            if (await eng.kv_stats()).disk_tier_writing == 0:
                break
        await anyio.sleep(0.05)
    kv = await eng.kv_stats(check_invariants=True)
    assert kv.records == 0 and kv.held_pages == 0, kv
    assert kv.free_pages + kv.tree_pages + kv.session_pages == kv.total_pages, kv
    assert kv.held_rows == kv.session_slots, kv
    return kv


@pytest.mark.anyio
async def test_five_turn_chat_equals_hf_and_prefills_only_each_new_turn(
    engine, tokenizer, hf_model
):
    client = engine.client
    params = GenerationParams(max_tokens=16, temperature=0.0)
    sid = (await client.open_session()).session_id
    filler = tokenizer.encode(natural_text(), add_special_tokens=False)
    messages: list[ChatMessage] = []
    previous = None  # (prompt tokens, completion tokens) of the last turn
    for k, question in enumerate(QUESTIONS):
        messages.append(ChatMessage(role="user", content=question))
        ids = (await client.tokenize(messages=messages)).tokens
        before = (await engine.scheduler_stats()).prompt_tokens
        res = await client.complete(params, messages=list(messages), session_id=sid)
        computed = (await engine.scheduler_stats()).prompt_tokens - before
        assert res.token_ids == hf_greedy(hf_model, ids, 16, tokenizer.eos_ids), f"turn {k}"
        if previous is None:
            assert res.cached_tokens == 0
        else:
            # The previous turn's prompt and output came from the session (but for the
            # last output token, sampled and never fed back, and any output tokens the
            # template re-renders differently).
            assert res.cached_tokens >= previous[0]
            assert res.cached_tokens <= previous[0] + previous[1] - 1
        assert computed == len(ids) - res.cached_tokens
        previous = (res.prompt_tokens, len(res.token_ids))
        messages.append(ChatMessage(role="assistant", content=res.text))
        # Other traffic between turns, enough to evict every page of the prefix tree.
        others = [[tokenizer.bos_id, *filler[500 * i : 500 * i + 499]] for i in range(3)]
        await engine.generate_batch(others, [GenerationParams(max_tokens=1)] * 3)
    assert (await engine.kv_stats()).evicted_pages > 0  # the flood did evict the tree
    info = await client.get_session(sid)
    assert info.turns == 5 and info.held_tokens > 0 and not info.busy
    kv = await settled(engine)
    assert kv.session_pages > 0
    closed = await client.close_session(sid)
    assert closed.closed
    kv = await settled(engine)
    assert kv.session_pages == 0 and kv.held_rows == 0 and kv.sessions_open == 0


@pytest.mark.anyio
async def test_abort_mid_turn_then_continue_gives_the_right_output(engine, tokenizer, hf_model):
    client = engine.client
    sid = (await client.open_session()).session_id
    messages = [ChatMessage(role="user", content="Tell me a long story about a fox.")]
    first = await client.complete(
        GenerationParams(max_tokens=8, temperature=0.0), messages=messages, session_id=sid
    )
    messages.append(ChatMessage(role="assistant", content=first.text))
    messages.append(ChatMessage(role="user", content="Go on, at length."))
    stream = client.generate(
        GenerationParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        messages=list(messages),
        session_id=sid,
    )
    async with contextlib.aclosing(stream):
        seen = 0
        async for chunk in stream:
            seen += len(chunk.token_ids)
            if seen >= 3:
                break  # the reader leaves: the turn is aborted
    for _ in range(100):  # the abort lands, then the session is free for the next turn
        info = await client.get_session(sid)
        if not info.busy:
            break
        await anyio.sleep(0.05)
    assert info.turns == 1 and info.held_tokens == 0  # wiped, tokens of turn 1 kept
    ids = (await client.tokenize(messages=messages)).tokens
    again = await client.complete(
        GenerationParams(max_tokens=10, temperature=0.0), messages=list(messages), session_id=sid
    )
    assert again.token_ids == hf_greedy(hf_model, ids, 10, tokenizer.eos_ids)
    await client.close_session(sid)
    kv = await settled(engine)
    assert kv.session_pages == 0 and kv.held_rows == 0


@pytest.mark.anyio
@pytest.mark.parametrize("tier", ["host", "disk"])
async def test_sessions_demoted_to_a_tier_continue_exactly(tokenizer, hf_model, tier, tmp_path):
    """Idle sessions get no share of the pool (every finished turn is demoted at once; with
    "disk" the host tier holds nothing, so every entry is written to a file) and other
    traffic evicts the prefix tree between turns: each next turn loads its history from the
    tier, answers as HF does, and reports the history cached; the tiers and the runner's
    store agree at every idle check, and the files go with the engine."""
    disk = {"kv__host_tier_bytes": 1, "kv__store_dir": str(tmp_path)} if tier == "disk" else {}
    disk = {**disk, "kv__disk_read_ahead_bytes": 0} if disk else {}  # read every file ahead
    # Sessions' entries only: evicted prefix-tree blocks stay out of these tiers.
    cfg = small_config(
        kv__num_pages=96, kv__tier_prefix_blocks=False, sessions__max_pinned_share=0.0, **disk
    )
    params = GenerationParams(max_tokens=12, temperature=0.0)
    filler = tokenizer.encode(natural_text(), add_special_tokens=False)
    async with ServingEngine(cfg) as eng:
        client = eng.client
        sid = (await client.open_session()).session_id
        messages: list[ChatMessage] = []
        previous = 0
        for k, question in enumerate(QUESTIONS[:3]):
            messages.append(ChatMessage(role="user", content=question))
            ids = (await client.tokenize(messages=messages)).tokens
            res = await client.complete(params, messages=list(messages), session_id=sid)
            assert res.token_ids == hf_greedy(hf_model, ids, 12, tokenizer.eos_ids), f"turn {k}"
            assert res.cached_tokens >= previous, f"turn {k}: the history was prefilled"
            previous = res.prompt_tokens
            messages.append(ChatMessage(role="assistant", content=res.text))
            for j in range(4):  # 4 new 500-token prompts (128 pages): the tree loses the turn
                start = 100 * k + 500 * j
                await client.complete(
                    GenerationParams(max_tokens=1), prompt_ids=filler[start : start + 500]
                )
        kv = await settled(eng)
        assert kv.session_pages == 0 and kv.session_demotes == 3 and kv.session_promotes == 2
        # The tree held none of the history: what was cached came from the host tier.
        assert kv.promoted_tokens >= previous - 16, kv
        if tier == "host":
            assert kv.host_tier_entries == 1 and 0 < kv.host_tier_bytes <= kv.host_tier_budget
        else:
            assert kv.host_tier_entries == 0 and kv.disk_tier_entries == 1
            assert kv.tier_spills == 3 and kv.disk_promotes == 2
            # each of those turns waited while its file was read beside the steps
            assert kv.disk_reads_ahead == 2
            assert len(list(tmp_path.rglob("*.kv"))) == 1
        assert kv.stored_tokens == (await client.get_session(sid)).held_tokens > previous
        assert kv.idle_checks > 0 and kv.idle_check_failures == 0 and kv.tier_failures == 0
        await client.close_session(sid)
        kv = await settled(eng)
        assert kv.host_tier_entries == kv.disk_tier_entries == kv.host_tier_bytes == 0
    assert list(tmp_path.rglob("*.kv")) == []


@pytest.mark.anyio
async def test_sessions_survive_a_drain_and_a_restart_on_the_same_store(
    tokenizer, hf_model, tmp_path
):
    """With kv.store_dir, a drain writes the idle sessions' KV to files and a manifest; the
    next engine on the same folder takes them back: the session answers under its id, with
    its turns, and its next turn loads the history from disk and answers as HF does."""
    cfg = small_config(kv__num_pages=96, kv__store_dir=str(tmp_path))
    params = GenerationParams(max_tokens=10, temperature=0.0)
    messages: list[ChatMessage] = []
    async with ServingEngine(cfg) as eng:
        sid = (await eng.client.open_session(ttl_s=600)).session_id
        for question in QUESTIONS[:2]:
            messages.append(ChatMessage(role="user", content=question))
            res = await eng.client.complete(params, messages=list(messages), session_id=sid)
            messages.append(ChatMessage(role="assistant", content=res.text))
        held = (await eng.client.get_session(sid)).held_tokens
        await eng.drain(5.0)
    assert len(list(tmp_path.rglob("*.kv"))) == 1 and len(list(tmp_path.rglob("sessions.json")))
    async with ServingEngine(cfg) as eng:
        info = await eng.client.get_session(sid)
        assert (info.turns, info.held_tokens) == (2, held)
        messages.append(ChatMessage(role="user", content=QUESTIONS[2]))
        ids = (await eng.client.tokenize(messages=messages)).tokens
        res = await eng.client.complete(params, messages=list(messages), session_id=sid)
        assert res.token_ids == hf_greedy(hf_model, ids, 10, tokenizer.eos_ids)
        assert res.cached_tokens >= 0.9 * held, (res.cached_tokens, held)
        kv = await settled(eng)
        assert kv.disk_promotes == 1 and kv.idle_check_failures == 0
    # No drain this time: the files went with the engine.
    assert list(tmp_path.rglob("*.kv")) == [] and list(tmp_path.rglob("sessions.json")) == []


@pytest.mark.anyio
async def test_session_refusals(engine):
    client = engine.client
    with pytest.raises(GenerationError) as unknown:
        await client.complete(GenerationParams(max_tokens=2), prompt="hi", session_id="nope")
    assert unknown.value.code == "session_not_found"
    small = await client.open_session(max_tokens=40)
    with pytest.raises(GenerationError) as full:
        await client.complete(
            GenerationParams(max_tokens=2), prompt="word " * 60, session_id=small.session_id
        )
    assert full.value.code == "invalid_request" and "max_tokens" in full.value.message
    # A turn too long for the rest of the capacity is cut to it: finish "length".
    res = await client.complete(
        GenerationParams(max_tokens=100, temperature=0.0, ignore_eos=True),
        prompt="one two three",
        session_id=small.session_id,
    )
    assert res.prompt_tokens + len(res.token_ids) == 40 and res.finish_reason == "length"
    await client.close_session(small.session_id)
    with pytest.raises(GenerationError):
        await client.get_session(small.session_id)
    await settled(engine)


# ---- HTTP and ZeroMQ -------------------------------------------------------------------------


def test_http_sessions_with_the_openai_client(server):
    base = server.base_url
    created = httpx.post(f"{base}/v1/sessions", json={"ttl_s": 60}, headers=server.auth)
    assert created.status_code == 200, created.text
    sid = created.json()["id"]
    assert created.json()["ttl_s"] == 60 and created.json()["turns"] == 0
    with openai.OpenAI(base_url=f"{base}/v1", api_key=server.api_key, max_retries=0) as oa:
        messages = [{"role": "user", "content": "Name three fruits."}]
        one = oa.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"session_id": sid},
        )
        messages.append({"role": "assistant", "content": one.choices[0].message.content})
        messages.append({"role": "user", "content": "And two vegetables."})
        two = oa.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"session_id": sid},
        )
        assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens
        got = httpx.get(f"{base}/v1/sessions/{sid}", headers=server.auth).json()
        assert got["turns"] == 2 and got["held_tokens"] > one.usage.prompt_tokens
        metrics = scrape_metrics(server)
        assert metrics["kvactor:sessions_open"] >= 1
        assert metrics['kvactor:kv_pages{state="session"}'] > 0
        assert metrics["kvactor:session_reclaims_total"] == 0  # nothing pressed it out

        # A client's hint before a long tool call: the KV leaves the pool for the host tier.
        off = httpx.post(f"{base}/v1/sessions/{sid}/offload", headers=server.auth)
        assert off.status_code == 200, off.text
        assert off.json()["held_tokens"] == got["held_tokens"]  # held, in the host tier
        assert off.json()["pool_tokens"] == 0
        metrics = scrape_metrics(server)
        assert metrics["kvactor:sessions_in_host_tier"] == 1
        assert metrics['kvactor:kv_host_tier_bytes{kind="used"}'] > 0
        assert metrics['kvactor:kv_pages{state="session"}'] == 0
        for bad in (f"/v1/sessions/{'x' * 24}/offload", f"/v1/sessions/{sid}/later"):
            assert httpx.post(f"{base}{bad}", headers=server.auth).status_code == 404
        # The tool call returns: the client has the KV brought back before the next turn.
        back = httpx.post(f"{base}/v1/sessions/{sid}/prefetch", headers=server.auth)
        assert back.status_code == 200, back.text
        assert back.json()["pool_tokens"] == back.json()["held_tokens"] == got["held_tokens"]
        metrics = scrape_metrics(server)
        assert metrics["kvactor:sessions_in_host_tier"] == 0
        assert metrics['kvactor:kv_pages{state="session"}'] > 0
        assert metrics["kvactor:session_promotes_total"] >= 1
        missing = f"{base}/v1/sessions/{'x' * 24}/prefetch"
        assert httpx.post(missing, headers=server.auth).status_code == 404
        httpx.post(f"{base}/v1/sessions/{sid}/offload", headers=server.auth)
        messages.append({"role": "assistant", "content": two.choices[0].message.content})
        messages.append({"role": "user", "content": "And one nut."})
        three = oa.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_body={"session_id": sid},
        )
        assert three.usage.prompt_tokens_details.cached_tokens >= two.usage.prompt_tokens
        assert scrape_metrics(server)["kvactor:session_promotes_total"] >= 1

        # One turn at a time: a second one while the first streams gets 409.
        stream = oa.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"session_id": sid, "ignore_eos": True},
        )
        with stream:
            next(iter(stream))
            with pytest.raises(openai.ConflictError) as busy:
                oa.chat.completions.create(
                    model=MODEL_NAME,
                    messages=messages,
                    max_tokens=2,
                    extra_body={"session_id": sid},
                )
            assert busy.value.status_code == 409
            assert busy.value.body["code"] == "session_busy"
        with pytest.raises(openai.NotFoundError):
            oa.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"session_id": "x" * 24}
            )
        with pytest.raises(openai.BadRequestError):
            oa.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=2, n=2, extra_body={"session_id": sid}
            )
    wait_idle(server)
    closed = httpx.delete(f"{base}/v1/sessions/{sid}", headers=server.auth)
    assert closed.status_code == 200 and closed.json()["closed"]
    assert httpx.get(f"{base}/v1/sessions/{sid}", headers=server.auth).status_code == 404
    assert httpx.delete(f"{base}/v1/sessions/{sid}", headers=server.auth).status_code == 404
    bad = httpx.post(f"{base}/v1/sessions", json={"ttl_s": -1}, headers=server.auth)
    assert bad.status_code == 400
    hinted = httpx.post(
        f"{base}/v1/sessions",
        json={"ttl_s": 60, "priority": 3, "retain_s": 30},
        headers=server.auth,
    )
    assert hinted.status_code == 200, hinted.text
    assert (hinted.json()["priority"], hinted.json()["retain_s"]) == (3, 30)
    for bad_hint in ({"ttl_s": 10, "retain_s": 20}, {"priority": 10**6}):
        refused = httpx.post(f"{base}/v1/sessions", json=bad_hint, headers=server.auth)
        assert refused.status_code == 400, refused.text
    assert httpx.post(f"{base}/v1/sessions", headers=server.auth).status_code == 200
    assert httpx.post(f"{base}/v1/sessions").status_code == 401  # the API key applies


@pytest.mark.anyio
async def test_zmq_sessions(server):
    async with KvactorClient(server.zmq_address, api_key=server.api_key) as client:
        info = await client.open_session(ttl_s=30, priority=-2, retain_s=10)
        assert (info.priority, info.retain_s) == (-2, 10)
        sid = info.session_id
        params = GenerationParams(max_tokens=6, temperature=0.0)
        first = await client.complete(
            prompt="The capital of France is", params=params, session_id=sid
        )
        prompt2 = "The capital of France is" + first.text + " and of Italy"
        second = await client.complete(prompt=prompt2, params=params, session_id=sid)
        assert second.usage.cached_tokens >= first.usage.prompt_tokens
        got = await client.get_session(sid)
        assert got.turns == 2 and got.held_tokens > 0
        offloaded = await client.offload_session(sid)
        assert offloaded.held_tokens == got.held_tokens  # in the host tier now
        assert offloaded.pool_tokens == 0
        back = await client.prefetch_session(sid)
        assert back.pool_tokens == back.held_tokens == got.held_tokens
        third = await client.complete(prompt=prompt2 + second.text, params=params, session_id=sid)
        assert third.usage.cached_tokens >= second.usage.prompt_tokens
        closed = await client.close_session(sid)
        assert closed.closed
        with pytest.raises(KvactorError) as gone:
            await client.get_session(sid)
        assert gone.value.code == "session_not_found"
        with pytest.raises(KvactorError) as unknown:
            await client.complete(prompt="hi", params=params, session_id=sid)
        assert unknown.value.code == "session_not_found"
    wait_idle(server)
