"""Streaming sessions through the real scheduler, allocator, radix and sessions actors.

The fake runner checks on every forward that each row points at KV written for that
request's own tokens, so a wrong restore (foreign or stale KV) fails the step; the
allocator runs the invariant checker after every message. The test plays the tokenizer's
part of the turn protocol (BeginTurn before submitting, EndTurn after the final report).
"""

from __future__ import annotations

import random

import anyio
import pytest

from actors.runtime import ActorSpec, RemoteError
from tests.actors.test_scheduler_actors import EOS, Harness
from transport.messages.alloc import KvStats, KvStatsRequest
from transport.messages.engine import (
    GenerationParams,
    NewRequest,
    SchedulerStats,
    SchedulerStatsRequest,
    SubmitRequests,
)
from transport.messages.sessions import (
    ERR_SESSION_BUSY,
    ERR_SESSION_LIMIT,
    ERR_SESSION_NOT_FOUND,
    BeginTurn,
    BeginTurnReply,
    CloseSession,
    EndTurn,
    GetSession,
    OffloadSession,
    OpenSession,
    SessionInfo,
)

PARAMS = GenerationParams(max_tokens=6, ignore_eos=True)


class SessionHarness(Harness):
    def __init__(self, num_pages, page_size=4, max_sessions=8, **kw):
        super().__init__(num_pages, page_size, **kw)
        self.specs.append(
            ActorSpec(
                "sessions",
                "actors.sessions:SessionsActor",
                {"context_len": 256, "max_sessions": max_sessions, "reap_every_s": 0.05},
            )
        )
        self._rid = 1000

    @property
    def sessions(self):
        return self.engine.ref("sessions")

    async def open(self, **kw) -> str:
        info = await self.sessions.call(OpenSession(**kw), expect=SessionInfo)
        return info.session_id

    async def turn(self, sid: str, prompt: list[int], params=PARAMS) -> tuple[int, list[int]]:
        """One whole turn as the tokenizer drives it: (rid, output tokens)."""
        self._rid += 1
        rid = self._rid
        reply = await self.sessions.call(
            BeginTurn(session_id=sid, rid=rid, prompt_tokens=len(prompt), max_new_tokens=6),
            expect=BeginTurnReply,
        )
        assert reply.ok, reply
        self.runner.prompts[rid] = prompt
        req = NewRequest(rid=rid, prompt_ids=prompt, params=params, eos_ids=[EOS], session_id=sid)
        await self.engine.ref("scheduler").send(SubmitRequests(reqs=[req]))
        await self.wait_done([rid])
        out = self.sink.outputs[rid]
        ok = self.sink.finish[rid] not in ("abort", "error")
        await self.sessions.send(
            EndTurn(session_id=sid, rid=rid, ok=ok, total_tokens=len(prompt) + len(out))
        )
        return rid, out

    async def plain(self, prompts: dict[int, list[int]], params=PARAMS) -> None:
        await self.submit(prompts, params)
        await self.wait_done(list(prompts))

    async def kv(self) -> KvStats:
        return await self.engine.ref("allocator").call(
            KvStatsRequest(check_invariants=True), expect=KvStats
        )

    async def sched(self) -> SchedulerStats:
        return await self.engine.ref("scheduler").call(
            SchedulerStatsRequest(), expect=SchedulerStats
        )

    async def demotions_done(self) -> None:
        """Wait until no session holds pool pages (every ended turn's demotion has run: the
        EndTurn that starts it is sent, not awaited)."""
        with anyio.fail_after(10):
            while (await self.kv()).session_pages:
                await anyio.sleep(0.01)

    async def settled(self) -> KvStats:
        """Wait for the engine to go idle; the KV must balance with the sessions' share."""
        with anyio.fail_after(10):
            while True:
                s = await self.sched()
                if s.waiting == s.running == s.prefilling == 0:
                    break
                await anyio.sleep(0.01)
        kv = await self.kv()
        assert kv.records == 0 and kv.held_pages == 0, kv
        assert kv.free_pages + kv.tree_pages + kv.session_pages == kv.total_pages, kv
        assert kv.held_rows == kv.session_slots, kv
        return kv


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 1000) for _ in range(n)]


def test_five_turns_prefill_only_each_new_turn_even_after_a_flood():
    async def go():
        rng = random.Random(1)
        async with SessionHarness(num_pages=80) as h:
            sid = await h.open()
            history: list[int] = []
            for k in range(5):
                prompt = history + rand_tokens(rng, 9)
                before = (await h.sched()).prompt_tokens
                rid, out = await h.turn(sid, prompt)
                computed = (await h.sched()).prompt_tokens - before
                if k == 0:
                    assert h.sink.cached[rid] == 0 and computed == len(prompt)
                else:
                    # The whole previous turn (prompt and output, but its last sampled
                    # token, never fed back) came from the session's KV.
                    assert h.sink.cached[rid] == len(history) - 1
                    assert computed == len(prompt) - len(history) + 1
                # The same conversation without a session gives the same tokens.
                await h.plain({9000 + k: prompt})
                assert h.sink.outputs[9000 + k] == out
                history = prompt + out
                # Enough other traffic between turns to evict the whole prefix tree.
                await h.plain({9100 + 10 * k + i: rand_tokens(rng, 60) for i in range(4)})
            info = await h.sessions.call(GetSession(session_id=sid), expect=SessionInfo)
            assert info.turns == 5 and info.tokens == len(history)
            assert info.held_tokens == len(history) - 1
            kv = await h.settled()
            assert kv.session_pages == -(-(len(history) - 1) // 4)
            await h.sessions.call(CloseSession(session_id=sid), expect=SessionInfo)
            kv = await h.settled()
            assert kv.session_pages == 0 and kv.sessions_open == 0 and kv.held_rows == 0

    anyio.run(go)


def test_eight_sessions_interleaved_with_plain_requests_on_a_small_pool():
    async def go():
        rng = random.Random(2)
        async with SessionHarness(num_pages=48, rows=24, chunk_size=8, max_batch_tokens=32) as h:
            sids = [await h.open() for _ in range(8)]
            histories = {sid: [] for sid in sids}

            async def conversation(sid):
                for _ in range(3):
                    prompt = histories[sid] + rand_tokens(rng, rng.randrange(3, 12))
                    _, out = await h.turn(sid, prompt)
                    histories[sid] = prompt + out

            async def traffic(i):
                await h.plain({5000 + i: rand_tokens(rng, rng.randrange(5, 40))})

            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(conversation, sid)
                for i in range(24):
                    tg.start_soon(traffic, i)
            assert all(len(h.sink.outputs[5000 + i]) == 6 for i in range(24))
            kv = await h.settled()
            assert kv.sessions_open == 8
            for sid in sids:
                await h.sessions.call(CloseSession(session_id=sid), expect=SessionInfo)
            kv = await h.settled()
            assert kv.session_pages == 0 and kv.held_rows == 0

    anyio.run(go)


def test_sessions_demoted_to_the_host_tier_load_their_history_back():
    """No pool share for idle sessions: every finished turn is demoted to the runner's host
    store, and every next turn gets its history back whole: from the prefix tree where it
    still holds it, else loaded from the store (the fake runner checks each forward's rows
    against the tokens it wrote, loaded ones included), interleaved with plain traffic that
    evicts the tree. How many turns find the tree evicted depends on how the four
    conversations interleave, so the loads are counted against the promotions, not fixed.
    Outputs equal the same conversations without a session."""

    async def go():
        rng = random.Random(3)
        tier = {"host_tier_bytes": 1 << 20, "session_max_pages": 0}
        async with SessionHarness(num_pages=64, rows=24, alloc=tier) as h:
            sids = [await h.open() for _ in range(4)]
            histories = {sid: [] for sid in sids}

            async def conversation(i, sid):
                for k in range(3):
                    prompt = histories[sid] + rand_tokens(rng, rng.randrange(3, 12))
                    await h.demotions_done()  # else a turn may race its own demotion
                    rid, out = await h.turn(sid, prompt)
                    if histories[sid]:
                        assert h.sink.cached[rid] == len(histories[sid]) - 1
                    await h.plain({7000 + 10 * i + k: prompt})
                    assert h.sink.outputs[7000 + 10 * i + k] == out
                    histories[sid] = prompt + out
                    await h.plain({8000 + 10 * i + k: rand_tokens(rng, 50)})

            async with anyio.create_task_group() as tg:
                for i, sid in enumerate(sids):
                    tg.start_soon(conversation, i, sid)
            kv = await h.settled()
            assert kv.session_pages == 0 and kv.host_tier_entries == 4
            assert kv.session_demotes == 12 and 1 <= kv.session_promotes <= 8, kv
            assert h.runner.loads == kv.session_promotes and len(h.runner.store) == 4
            assert kv.idle_check_failures == 0 and kv.tier_failures == 0
            info = await h.sessions.call(OffloadSession(session_id=sids[0]), expect=SessionInfo)
            assert info.held_tokens == len(histories[sids[0]]) - 1  # already in the tier
            for sid in sids:
                await h.sessions.call(CloseSession(session_id=sid), expect=SessionInfo)
            kv = await h.settled()
            assert kv.host_tier_entries == 0 and h.runner.store == {}

    anyio.run(go)


def test_an_offload_hint_moves_the_kv_and_waits_for_a_running_turn():
    async def go():
        async with SessionHarness(num_pages=64, alloc={"host_tier_bytes": 1 << 20}) as h:
            sid = await h.open()
            prompt = list(range(200, 230))
            _, out = await h.turn(sid, prompt)
            assert (await h.kv()).session_pages == 9  # 35 positions
            info = await h.sessions.call(OffloadSession(session_id=sid), expect=SessionInfo)
            assert info.held_tokens == 35
            kv = await h.settled()
            assert kv.session_pages == 0 and kv.host_tier_entries == 1 and kv.stored_tokens == 35
            begin = BeginTurn(session_id=sid, rid=5, prompt_tokens=40, max_new_tokens=6)
            assert (await h.sessions.call(begin, expect=BeginTurnReply)).ok
            with pytest.raises(RemoteError) as busy:
                await h.sessions.call(OffloadSession(session_id=sid), expect=SessionInfo)
            assert busy.value.reply.code == ERR_SESSION_BUSY
            await h.sessions.send(EndTurn(session_id=sid, rid=5, ok=False, total_tokens=0))
            rid, _ = await h.turn(sid, prompt + out + [7, 8, 9])
            assert h.sink.cached[rid] == 35 and h.runner.loads == 1

    anyio.run(go)


def test_one_turn_at_a_time_and_a_close_waits_for_the_running_turn():
    async def go():
        async with SessionHarness(num_pages=64) as h:
            sid = await h.open()
            begin = BeginTurn(session_id=sid, rid=1, prompt_tokens=5, max_new_tokens=6)
            assert (await h.sessions.call(begin, expect=BeginTurnReply)).ok
            again = BeginTurn(session_id=sid, rid=2, prompt_tokens=5, max_new_tokens=6)
            busy = await h.sessions.call(again, expect=BeginTurnReply)
            assert not busy.ok and busy.code == ERR_SESSION_BUSY
            h.runner.prompts[1] = [101, 102, 103, 104, 105]
            req = NewRequest(
                rid=1,
                prompt_ids=[101, 102, 103, 104, 105],
                params=PARAMS,
                eos_ids=[],
                session_id=sid,
            )
            await h.engine.ref("scheduler").send(SubmitRequests(reqs=[req]))
            closing = await h.sessions.call(CloseSession(session_id=sid), expect=SessionInfo)
            assert closing.closed and closing.busy
            await h.wait_done([1])
            await h.sessions.send(EndTurn(session_id=sid, rid=1, ok=True, total_tokens=11))
            with anyio.fail_after(5):
                while (await h.kv()).sessions_open:
                    await anyio.sleep(0.01)
            kv = await h.settled()
            assert kv.session_pages == 0 and kv.held_rows == 0
            with pytest.raises(RemoteError) as gone:
                await h.sessions.call(GetSession(session_id=sid), expect=SessionInfo)
            assert gone.value.reply.code == ERR_SESSION_NOT_FOUND

    anyio.run(go)


def test_an_idle_session_times_out_and_its_kv_comes_back():
    async def go():
        async with SessionHarness(num_pages=64, max_sessions=1) as h:
            sid = await h.open(ttl_s=0.3)
            await h.turn(sid, [101, 102, 103, 104, 105, 106])
            assert (await h.settled()).session_pages > 0
            with pytest.raises(RemoteError) as full:
                await h.open()
            assert full.value.reply.code == ERR_SESSION_LIMIT
            with anyio.fail_after(5):
                while (await h.kv()).sessions_open:
                    await anyio.sleep(0.05)
            kv = await h.settled()
            assert kv.session_pages == 0 and kv.held_rows == 0
            refused = await h.sessions.call(
                BeginTurn(session_id=sid, rid=7, prompt_tokens=3, max_new_tokens=1),
                expect=BeginTurnReply,
            )
            assert not refused.ok and refused.code == ERR_SESSION_NOT_FOUND
            await h.open()  # the slot is free again

    anyio.run(go)


def test_an_aborted_turn_wipes_the_kv_and_the_next_turn_recomputes():
    async def go():
        rng = random.Random(3)
        async with SessionHarness(num_pages=64) as h:
            sid = await h.open()
            prompt = rand_tokens(rng, 12)
            _, out = await h.turn(sid, prompt)
            history = prompt + out
            # A long turn, aborted while it decodes.
            rid = 2000
            long_prompt = history + rand_tokens(rng, 5)
            assert (
                await h.sessions.call(
                    BeginTurn(
                        session_id=sid, rid=rid, prompt_tokens=len(long_prompt), max_new_tokens=200
                    ),
                    expect=BeginTurnReply,
                )
            ).ok
            h.runner.prompts[rid] = long_prompt
            req = NewRequest(
                rid=rid,
                prompt_ids=long_prompt,
                params=GenerationParams(max_tokens=200, ignore_eos=True),
                eos_ids=[],
                session_id=sid,
            )
            await h.engine.ref("scheduler").send(SubmitRequests(reqs=[req]))
            with anyio.fail_after(10):
                while len(h.sink.outputs.get(rid, [])) < 3:
                    await anyio.sleep(0.005)
            await h.end([rid])
            await h.wait_done([rid])
            assert h.sink.finish[rid] == "abort"
            await h.sessions.send(EndTurn(session_id=sid, rid=rid, ok=False, total_tokens=0))
            kv = await h.settled()
            assert kv.session_pages == 0  # wiped
            info = await h.sessions.call(GetSession(session_id=sid), expect=SessionInfo)
            assert info.turns == 1 and info.tokens == len(history) and info.held_tokens == 0
            # The next turn (from the last good one) is computed again, correctly.
            nxt = history + rand_tokens(rng, 4)
            rid3, out3 = await h.turn(sid, nxt)
            assert h.sink.cached[rid3] == 0
            await h.plain({9999: nxt})
            assert h.sink.outputs[9999] == out3

    anyio.run(go)


def test_a_request_never_waits_behind_idle_sessions_that_fill_the_pool():
    """Three idle sessions pin 36 of 40 pages; a plain request needing 9 is served: the
    least recently used session's KV goes to the prefix tree (counted), the others stay."""

    async def go():
        rng = random.Random(3)
        async with SessionHarness(num_pages=40) as h:
            sids = [await h.open() for _ in range(3)]
            for sid in sids:
                await h.turn(sid, rand_tokens(rng, 42))  # 47 with output: 12 pages each
            kv = await h.settled()
            assert kv.session_pages == 36 and kv.session_reclaims == 0
            with anyio.fail_after(20):
                await h.plain({7000: rand_tokens(rng, 30)})
            # Served in full (before: cut at "length" with no token, a silent failure).
            assert len(h.sink.outputs[7000]) == PARAMS.max_tokens
            kv = await h.settled()
            assert kv.session_reclaims == 1 and kv.session_slots == 2
            # The released session still takes turns (prefilling what the tree lost).
            rid, _ = await h.turn(sids[0], rand_tokens(rng, 10))
            assert h.sink.finish[rid] not in ("abort", "error")
            await h.settled()

    anyio.run(go)


def test_a_request_is_served_when_idle_sessions_pin_the_pool_through_the_tree():
    """Idle sessions whose KV lies mostly in the prefix tree (a long prompt's first chunk
    is cached there, locked by the session): a request needing more than the free pages
    and the sessions' own pages is served by releasing them. It was cut short with an
    error: only the sessions' own pages counted as reclaimable (found by `bench sessions`
    with 1,000-token turns)."""

    async def go():
        rng = random.Random(4)
        async with SessionHarness(num_pages=42, chunk_size=64, max_batch_tokens=64) as h:
            sids = [await h.open() for _ in range(2)]
            for sid in sids:
                await h.turn(sid, rand_tokens(rng, 70))  # a 64-token chunk goes to the tree
            kv = await h.settled()
            need = -(-48 // 4)  # the plain request's prompt, one chunk
            assert kv.free_pages + kv.session_pages < need, kv
            assert kv.evictable_pages == 0 and kv.reclaimable_pages >= need, kv
            with anyio.fail_after(20):
                await h.plain({7000: rand_tokens(rng, 48)})
            assert h.sink.finish[7000] not in ("abort", "error")
            assert len(h.sink.outputs[7000]) == PARAMS.max_tokens
            kv = await h.settled()
            assert kv.session_reclaims >= 1
            for sid in sids:  # released or not, each session still takes turns
                rid, _ = await h.turn(sid, rand_tokens(rng, 10))
                assert h.sink.finish[rid] not in ("abort", "error")
            await h.settled()

    anyio.run(go)
