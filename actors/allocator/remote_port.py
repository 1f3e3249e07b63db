"""A `PrefixPort` that reaches the radix cache actor over its mailbox."""

from __future__ import annotations

import numpy as np

from actors.runtime import ActorRef
from kvcore import MatchResult, TreeSnapshot
from kvcore.radix_tree import EvictedBlock, InsertResult
from transport.messages.radix import (
    EvictBlocks,
    EvictedBlocks,
    EvictPages,
    EvictReply,
    InsertPrefix,
    InsertReply,
    MatchAndLock,
    MatchReply,
    TreeSnapshotReply,
    TreeSnapshotRequest,
    TreeStats,
    TreeStatsRequest,
    UnlockablePages,
    UnlockablePagesReply,
    UnlockNode,
)


class RemotePrefixPort:
    def __init__(self, radix: ActorRef, page_size: int) -> None:
        self.radix = radix
        self.page_size = page_size

    async def match_and_lock(self, tokens: np.ndarray) -> MatchResult:
        r = await self.radix.call(MatchAndLock(tokens=tokens.tolist()), expect=MatchReply)
        return MatchResult(r.length, np.asarray(r.slots, dtype=np.int64), r.node_id)

    async def insert(
        self,
        tokens: np.ndarray,
        slots: np.ndarray,
        unlock_node: int | None,
        lock_new: bool,
        alive: np.ndarray | None = None,
        need_alive_from: int | None = None,
    ) -> InsertResult:
        msg = InsertPrefix(
            tokens=tokens.tolist(),
            slots=slots.tolist(),
            unlock_node=-1 if unlock_node is None else unlock_node,
            lock_new=lock_new,
            alive=[] if alive is None else np.asarray(alive, dtype=bool).tolist(),
            need_alive_from=-1 if need_alive_from is None else need_alive_from,
        )
        r = await self.radix.call(msg, expect=InsertReply)
        return InsertResult(
            r.existing_len,
            r.node_id,
            np.asarray(r.slots, dtype=np.int64),
            r.length,
            np.asarray(r.released, dtype=np.int64),
        )

    async def unlock(self, node_id: int) -> None:
        await self.radix.call(UnlockNode(node_id=node_id))

    async def pages_freed_by_unlocking(self, node_ids: list[int]) -> np.ndarray:
        msg = UnlockablePages(node_ids=list(node_ids))
        r = await self.radix.call(msg, expect=UnlockablePagesReply)
        return np.asarray(r.pages, dtype=np.int64)

    async def evict(self, num_pages: int) -> np.ndarray:
        r = await self.radix.call(EvictPages(num_pages=num_pages), expect=EvictReply)
        return np.asarray(r.pages, dtype=np.int64)

    async def evict_blocks(self, num_pages: int) -> list[EvictedBlock]:
        r = await self.radix.call(EvictBlocks(num_pages=num_pages), expect=EvictedBlocks)
        return [
            EvictedBlock(
                start,
                np.asarray(key, dtype=np.int64),
                np.asarray(slots, dtype=np.int64),
                np.asarray(alive, dtype=bool),
            )
            for start, key, slots, alive in zip(r.starts, r.keys, r.slots, r.alive)
        ]

    async def owned_pages(self) -> np.ndarray:
        r = await self.radix.call(TreeStatsRequest(with_pages=True), expect=TreeStats)
        return np.asarray(r.pages, dtype=np.int64)

    async def stats(self) -> TreeStats:
        return await self.radix.call(TreeStatsRequest(), expect=TreeStats)

    async def evictable_pages(self) -> int:
        return (await self.stats()).evictable_tokens // self.page_size

    async def sizes(self) -> tuple[int, int]:
        s = await self.stats()
        return s.evictable_tokens, s.protected_tokens

    async def snapshot(self) -> TreeSnapshot:
        r = await self.radix.call(TreeSnapshotRequest(), expect=TreeSnapshotReply)
        return TreeSnapshot(
            page_size=self.page_size,
            ids=r.ids,
            parents=r.parents,
            keys=[np.asarray(k, dtype=np.int64) for k in r.keys],
            values=[np.asarray(v, dtype=np.int64) for v in r.values],
            lock_refs=r.lock_refs,
            evictable_size=r.evictable_tokens,
            protected_size=r.protected_tokens,
            alive=[np.asarray(a, dtype=bool) for a in r.alive],
        )
