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
