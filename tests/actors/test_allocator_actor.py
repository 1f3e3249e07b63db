"""The allocator and radix cache actors behind real ZeroMQ sockets (inproc and ipc).

A scripted random workload (admission with shared prefixes, chunked prefill,
cache-unfinished, decode, finish / abort / retract) runs through the actors'
mailboxes; the invariant checker runs inside the allocator after every message
(debug mode) and is also asked for from the outside.
"""

from __future__ import annotations

import random

import anyio
import pytest

from actors.runtime import ActorSpec, ActorSystem
from transport.messages.alloc import (
    AllocDecode,
    AllocDecodeReply,
    AllocExtend,
    AllocExtendReply,
    CacheUnfinished,
    CacheUnfinishedReply,
    DraftCommit,
    ExtendItem,
    KvStats,
    KvStatsRequest,
    ReleaseBatch,
    ReleaseItem,
    ReleaseKind,
)


def kv_specs(num_pages=48, page_size=4, rows=6, capacity=96, group="kv"):
    return [
        ActorSpec(
            "radix", "actors.radix_cache:RadixCacheActor", {"page_size": page_size}, group=group
        ),
        ActorSpec(
            "allocator",
            "actors.allocator.actor:AllocatorActor",
            {
                "num_pages": num_pages,
                "page_size": page_size,
                "max_rows": rows,
                "row_capacity": capacity,
                "debug_checks": True,
            },
            group=group,
        ),
    ]


async def drive_workload(alloc, seed: int, steps: int = 120) -> dict[str, int]:
    rng = random.Random(seed)
    base = [rng.randrange(1000) for _ in range(40)]
    tokens: dict[int, list[int]] = {}
    done: dict[int, int] = {}  # committed length per held request
    counts = {"admitted": 0, "decode_short": 0, "finish": 0, "abort": 0, "retract": 0}
    next_rid = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.25 or not tokens:
            cut = rng.randrange(0, 40)
            tokens[next_rid] = base[:cut] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 20))
            ]
            next_rid += 1
        elif op < 0.5:
            pending = [r for r in tokens if done.get(r, -1) < len(tokens[r])]
            if not pending:
                continue
            batch = rng.sample(pending, min(len(pending), 3))
            reply = await alloc.call(
                AllocExtend(
                    items=[
                        ExtendItem(rid=r, tokens=tokens[r], budget=rng.randrange(4, 32))
                        for r in batch
                    ]
                ),
                expect=AllocExtendReply,
            )
            unfinished = []
            for g in reply.grants:
                if g.row >= 0:
                    counts["admitted"] += g.start == g.cached_len
                    done[g.rid] = g.end
                    if g.end < len(tokens[g.rid]):
                        unfinished.append(g.rid)
            if unfinished:
                await alloc.call(
                    CacheUnfinished(rids=unfinished, tokens=[tokens[r] for r in unfinished]),
                    expect=CacheUnfinishedReply,
                )
        elif op < 0.8:
            ready = [r for r in tokens if done.get(r) == len(tokens[r])]
            if not ready:
                continue
            reply = await alloc.call(AllocDecode(rids=ready), expect=AllocDecodeReply)
            if reply.short_pages:
                counts["decode_short"] += 1
                victim = rng.choice(ready)
                await alloc.call(
                    ReleaseBatch(
                        items=[
                            ReleaseItem(rid=victim, kind=ReleaseKind.RETRACT, tokens=tokens[victim])
                        ]
                    )
                )
                counts["retract"] += 1
                del done[victim]
            else:
                assert sum(reply.deltas.lengths) == len(ready)
                for r in ready:
                    tokens[r].append(rng.randrange(1000))
                    done[r] += 1
        else:
            held = [r for r in tokens if r in done]
            if not held:
                continue
            r = rng.choice(held)
            finished = done[r] == len(tokens[r]) and rng.random() < 0.7
            kind = ReleaseKind.FINISH if finished else ReleaseKind.ABORT
            await alloc.call(ReleaseBatch(items=[ReleaseItem(rid=r, kind=kind, tokens=tokens[r])]))
            counts["finish" if finished else "abort"] += 1
            del done[r], tokens[r]
    # Drain: abort everything still alive.
    items = [ReleaseItem(rid=r, kind=ReleaseKind.ABORT) for r in tokens]
    await alloc.call(ReleaseBatch(items=items))
    return counts


@pytest.mark.parametrize("transport", ["inproc", "ipc"])
def test_allocator_actor_workload_keeps_invariants(transport):
    async def main():
        async with ActorSystem(kv_specs(), transport=transport) as engine:
            alloc = engine.ref("allocator")
            counts = await drive_workload(alloc, seed=7)
            stats = await alloc.call(KvStatsRequest(check_invariants=True), expect=KvStats)
            assert counts["admitted"] > 5 and counts["finish"] > 0
            assert stats.held_pages == 0 and stats.records == 0 and stats.held_rows == 0
            assert stats.free_pages + stats.tree_pages == stats.total_pages
            assert stats.evictable_pages == stats.tree_pages  # no lock leaked
            health = await engine.health()
            assert all(h.up for h in health.values())

    anyio.run(main)


def test_bad_message_to_allocator_is_an_error_and_changes_nothing():
    async def main():
        async with ActorSystem(kv_specs(), transport="inproc") as engine:
            alloc = engine.ref("allocator")
            before = await alloc.call(KvStatsRequest(), expect=KvStats)
            from actors.runtime import RemoteError

            with pytest.raises(RemoteError, match="holds no KV"):
                await alloc.call(AllocDecode(rids=[12345]))
            with pytest.raises(RemoteError, match="exceed row capacity"):
                await alloc.call(
                    AllocExtend(items=[ExtendItem(rid=1, tokens=list(range(500)), budget=8)])
                )
            after = await alloc.call(KvStatsRequest(check_invariants=True), expect=KvStats)
            assert after.free_pages == before.free_pages and after.records == before.records == 0

    anyio.run(main)


def test_batched_messages_are_all_or_nothing():
    """An item that would raise leaves the earlier items of its message undone."""

    async def main():
        from actors.runtime import RemoteError

        async with ActorSystem(kv_specs(), transport="inproc") as engine:
            alloc = engine.ref("allocator")
            before = await alloc.call(KvStatsRequest(), expect=KvStats)
            good = ExtendItem(rid=1, tokens=list(range(10, 30)), budget=8)
            with pytest.raises(RemoteError, match="budget must be >= 1"):
                await alloc.call(
                    AllocExtend(items=[good, ExtendItem(rid=2, tokens=[1, 2], budget=0)])
                )
            with pytest.raises(RemoteError, match="twice"):
                await alloc.call(AllocExtend(items=[good, good]))
            after = await alloc.call(KvStatsRequest(check_invariants=True), expect=KvStats)
            assert after.records == 0 and after.free_pages == before.free_pages
            # A held request, then a release batch whose second item is bad.
            reply = await alloc.call(AllocExtend(items=[good]), expect=AllocExtendReply)
            assert reply.grants[0].row >= 0
            held = await alloc.call(KvStatsRequest(), expect=KvStats)
            finish = ReleaseItem(rid=1, kind=ReleaseKind.FINISH, tokens=list(range(10, 18)))
            with pytest.raises(RemoteError, match="holds no KV"):
                await alloc.call(
                    ReleaseBatch(items=[finish, ReleaseItem(rid=99, kind=ReleaseKind.RETRACT)])
                )
            with pytest.raises(RemoteError, match="twice"):
                await alloc.call(AllocDecode(rids=[1, 1]))
            still = await alloc.call(KvStatsRequest(check_invariants=True), expect=KvStats)
            assert still.records == 1 and still.free_pages == held.free_pages
            await alloc.call(ReleaseBatch(items=[ReleaseItem(rid=1, kind=ReleaseKind.ABORT)]))

    anyio.run(main)


def test_draft_commits_ride_with_their_message_and_are_undone_with_it():
    """Speculative commits are applied first, but checked with the rest: a bad item leaves
    the commit undone too; a finish in the same batch as its commit is at rest."""

    async def main():
        from actors.runtime import RemoteError

        async with ActorSystem(kv_specs(), transport="inproc") as engine:
            alloc = engine.ref("allocator")
            tokens = list(range(10, 30))
            reply = await alloc.call(
                AllocExtend(items=[ExtendItem(rid=1, tokens=tokens, budget=32)]),
                expect=AllocExtendReply,
            )
            assert reply.grants[0].end == 20
            reserved = await alloc.call(AllocDecode(rids=[1], drafts=[5]), expect=AllocDecodeReply)
            assert reserved.short_pages == 0 and sum(reserved.deltas.lengths) == 6
            before = await alloc.call(KvStatsRequest(), expect=KvStats)
            commit = [DraftCommit(rid=1, accepted=2)]
            with pytest.raises(RemoteError, match="twice"):
                await alloc.call(AllocDecode(rids=[1, 1], commits=commit))
            with pytest.raises(RemoteError, match="context full"):
                await alloc.call(AllocDecode(rids=[1], drafts=[200], commits=commit))
            with pytest.raises(RemoteError, match="holds no KV"):
                await alloc.call(
                    ReleaseBatch(
                        items=[ReleaseItem(rid=99, kind=ReleaseKind.FINISH)], commits=commit
                    )
                )
            with pytest.raises(RemoteError, match="not committed"):
                await alloc.call(
                    ReleaseBatch(items=[ReleaseItem(rid=1, kind=ReleaseKind.FINISH, tokens=tokens)])
                )
            after = await alloc.call(KvStatsRequest(check_invariants=True), expect=KvStats)
            assert after.free_pages == before.free_pages  # every refusal left the commit out
            # The commit and the finish in one batch: the record is at rest when released.
            done = [*tokens, 40, 41]
            await alloc.call(
                ReleaseBatch(
                    items=[ReleaseItem(rid=1, kind=ReleaseKind.FINISH, tokens=done)],
                    commits=commit,
                )
            )
            idle = await alloc.call(KvStatsRequest(check_invariants=True), expect=KvStats)
            assert idle.records == 0 and idle.free_pages + idle.tree_pages == idle.total_pages

    anyio.run(main)


def test_idle_check_is_always_on_and_counted():
    async def main():
        from transport.messages.alloc import IdleCheck, IdleCheckReply

        specs = kv_specs()
        specs[1] = ActorSpec(
            "allocator", specs[1].factory, {**specs[1].kwargs, "debug_checks": False}
        )
        async with ActorSystem(specs, transport="inproc") as engine:
            alloc = engine.ref("allocator")
            reply = await alloc.call(IdleCheck(), expect=IdleCheckReply)
            assert reply.problems == []
            await alloc.call(
                AllocExtend(items=[ExtendItem(rid=5, tokens=list(range(9)), budget=9)])
            )
            reply = await alloc.call(IdleCheck(), expect=IdleCheckReply)  # a request holds KV
            assert any("1 request records left" in p for p in reply.problems), reply.problems
            stats = await alloc.call(KvStatsRequest(), expect=KvStats)
            assert stats.idle_checks == 2 and stats.idle_check_failures == 1

    anyio.run(main)
