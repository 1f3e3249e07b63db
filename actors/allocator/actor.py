"""The allocator actor: sole owner of every request's `ReqKvInfo`.

Wraps `KvLedger` in a mailbox, so every KV ownership transition (admission,
chunk, decode slot, cache-unfinished, finish, abort, retract) happens here, one
message at a time. Each message carries a whole step's requests. In debug mode
the invariant checker runs after every mutating message.
"""

from __future__ import annotations

import numpy as np

from actors.allocator.ledger import KvLedger, SlotDelta
from actors.allocator.remote_port import RemotePrefixPort
from actors.runtime import Actor
from kvcore import PagePool, ReqToTokenTable
from transport.messages.alloc import (
    AllocDecode,
    AllocDecodeReply,
    AllocExtend,
    AllocExtendReply,
    CacheUnfinished,
    CacheUnfinishedReply,
    ExtendGrantItem,
    KvStats,
    KvStatsRequest,
    ReleaseBatch,
    ReleaseKind,
    SlotDeltas,
)


def pack_deltas(deltas: list[SlotDelta]) -> SlotDeltas:
    if not deltas:
        return SlotDeltas()
    return SlotDeltas(
        rows=[d.row for d in deltas],
        starts=[d.start for d in deltas],
        lengths=[len(d.slots) for d in deltas],
        slots=np.concatenate([d.slots for d in deltas]).tolist(),
    )


class AllocatorActor(Actor):
    inbox = AllocExtend | AllocDecode | CacheUnfinished | ReleaseBatch | KvStatsRequest

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_rows: int,
        row_capacity: int,
        radix: str | None = "radix",
        debug_checks: bool = False,
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.table = ReqToTokenTable(max_rows, row_capacity)
        self.radix_name = radix
        self.debug_checks = debug_checks
        self.ledger: KvLedger | None = None
        self.port: RemotePrefixPort | None = None

    async def on_start(self) -> None:
        self.port = RemotePrefixPort(self.ref(self.radix_name)) if self.radix_name else None
        self.ledger = KvLedger(self.pool, self.table, self.port)

    async def handle(self, msg, sender):
        ledger = self.ledger
        if isinstance(msg, AllocDecode):
            deltas: list[SlotDelta] = []
            short = await ledger.alloc_decode(list(msg.rids), deltas)
            reply = AllocDecodeReply(short_pages=short, deltas=pack_deltas(deltas))
        elif isinstance(msg, AllocExtend):
            deltas = []
            grants = []
            for item in msg.items:
                toks = np.asarray(item.tokens, dtype=np.int64)
                g = await ledger.alloc_extend(item.rid, toks, item.budget, deltas)
                if g is None:
                    grants.append(
                        ExtendGrantItem(rid=item.rid, row=-1, cached_len=0, start=0, end=0)
                    )
                else:
                    grants.append(
                        ExtendGrantItem(
                            rid=g.rid, row=g.row, cached_len=g.cached_len, start=g.start, end=g.end
                        )
                    )
            reply = AllocExtendReply(grants=grants, deltas=pack_deltas(deltas))
        elif isinstance(msg, CacheUnfinished):
            deltas = []
            for rid, toks in zip(msg.rids, msg.tokens):
                await ledger.cache_unfinished(rid, np.asarray(toks, dtype=np.int64), deltas)
            reply = CacheUnfinishedReply(deltas=pack_deltas(deltas))
        elif isinstance(msg, ReleaseBatch):
            for item in msg.items:
                toks = np.asarray(item.tokens, dtype=np.int64)
                if item.kind is ReleaseKind.FINISH:
                    await ledger.finish(item.rid, toks)
                    ledger.forget(item.rid)
                elif item.kind is ReleaseKind.ABORT:
                    await ledger.abort(item.rid)
                    ledger.forget(item.rid)
                else:
                    await ledger.retract(item.rid, toks)
            reply = None
        elif isinstance(msg, KvStatsRequest):
            return await self._stats(msg.check_invariants)
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        if self.debug_checks:
            await ledger.check()
        return reply

    async def _stats(self, check: bool) -> KvStats:
        ledger = self.ledger
        if check:
            await ledger.check()
        ps = self.pool.page_size
        tree_pages = evictable = 0
        if self.port is not None:
            ts = await self.port.stats()
            tree_pages = (ts.evictable_tokens + ts.protected_tokens) // ps
            evictable = ts.evictable_tokens // ps
        c = ledger.counters
        return KvStats(
            page_size=ps,
            total_pages=self.pool.num_pages,
            free_pages=self.pool.num_free,
            tree_pages=tree_pages,
            held_pages=ledger.held_pages(),
            session_pages=0,
            evictable_pages=evictable,
            records=len(ledger.records),
            held_rows=len(self.table.held_rows()),
            cache_hit_tokens=c.cache_hit_tokens,
            evicted_pages=c.evicted_pages,
            admitted=c.admitted,
            finished=c.finished,
            aborted=c.aborted,
            retracted=c.retracted,
        )

    def stats(self) -> dict[str, int | float]:
        return {"kv_free_pages": self.pool.num_free, "kv_total_pages": self.pool.num_pages}
