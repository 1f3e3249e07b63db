"""The radix cache actor: the prefix tree as a service.

Owns one `kvcore.RadixTree`. The allocator is the only sender of the mutating
messages (match-and-lock, insert, unlock, evict), so page transfers between the
tree and the page pool happen in the allocator's mailbox order. The scheduler
may `PeekPrefix` (read-only) for longest-prefix-match scheduling.
"""

from __future__ import annotations

import secrets

import numpy as np

from actors.runtime import Actor
from kvcore import RadixTree
from kvcore.prefix_digest import pack
from transport.messages.radix import (
    EvictBlocks,
    EvictedBlocks,
    EvictPages,
    EvictReply,
    InsertPrefix,
    InsertReply,
    MatchAndLock,
    MatchReply,
    PeekPrefix,
    PeekReply,
    TreeDigest,
    TreeDigestRequest,
    TreeSnapshotReply,
    TreeSnapshotRequest,
    TreeStats,
    TreeStatsRequest,
    UnlockablePages,
    UnlockablePagesReply,
    UnlockNode,
)


class RadixCacheActor(Actor):
    inbox = (
        MatchAndLock
        | InsertPrefix
        | UnlockNode
        | EvictPages
        | EvictBlocks
        | UnlockablePages
        | PeekPrefix
        | TreeStatsRequest
        | TreeSnapshotRequest
        | TreeDigestRequest
    )

    def __init__(self, page_size: int, sliding_window: int = 0) -> None:
        self.tree = RadixTree(page_size, window=sliding_window)
        self._digest: TreeDigest | None = None  # the last one made (of its version)
        # Digest versions of this process: a restarted tree never repeats an older one.
        self._epoch = secrets.randbits(20) << 40

    async def handle(self, msg, sender):
        tree = self.tree
        if isinstance(msg, MatchAndLock):
            m = tree.match_and_lock(np.asarray(msg.tokens, dtype=np.int64))
            return MatchReply(length=m.length, slots=m.slots.tolist(), node_id=m.node_id)
        if isinstance(msg, InsertPrefix):
            res = tree.insert_and_relock(
                np.asarray(msg.tokens, dtype=np.int64),
                np.asarray(msg.slots, dtype=np.int64),
                None if msg.unlock_node < 0 else msg.unlock_node,
                msg.lock_new,
                alive=np.asarray(msg.alive, dtype=bool) if msg.alive else None,
                need_alive_from=None if msg.need_alive_from < 0 else msg.need_alive_from,
            )
            return InsertReply(
                existing_len=res.existing_len,
                node_id=res.node_id,
                slots=res.slots.tolist(),
                length=res.length,
                released=res.released.tolist(),
            )
        if isinstance(msg, UnlockNode):
            tree.dec_lock_ref(msg.node_id)
            return None
        if isinstance(msg, EvictPages):
            return EvictReply(pages=tree.evict(msg.num_pages).tolist())
        if isinstance(msg, UnlockablePages):
            pages = tree.pages_freed_by_unlocking(msg.node_ids)
            return UnlockablePagesReply(pages=pages.tolist())
        if isinstance(msg, EvictBlocks):
            blocks = tree.evict_blocks(msg.num_pages)
            return EvictedBlocks(
                starts=[b.start for b in blocks],
                keys=[b.key.tolist() for b in blocks],
                slots=[b.slots.tolist() for b in blocks],
                alive=[b.alive.tolist() for b in blocks],
            )
        if isinstance(msg, PeekPrefix):
            return PeekReply(lengths=[tree.match_prefix(t).length for t in msg.tokens])
        if isinstance(msg, TreeStatsRequest):
            return TreeStats(
                evictable_tokens=tree.evictable_size,
                protected_tokens=tree.protected_size,
                nodes=tree.num_nodes,
                pages=tree.owned_pages().tolist() if msg.with_pages else [],
            )
        if isinstance(msg, TreeSnapshotRequest):
            snap = tree.snapshot()
            return TreeSnapshotReply(
                ids=snap.ids,
                parents=snap.parents,
                keys=[k.tolist() for k in snap.keys],
                values=[v.tolist() for v in snap.values],
                lock_refs=snap.lock_refs,
                evictable_tokens=snap.evictable_size,
                protected_tokens=snap.protected_size,
                alive=[a.tolist() for a in snap.alive],
            )
        if isinstance(msg, TreeDigestRequest):
            return self.digest(msg.since)
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def digest(self, since: int) -> TreeDigest:
        """The tree's digest, made once per tree version (each router polls it)."""
        version = self._epoch + self.tree.version
        if since == version:
            return TreeDigest(version=version, block_tokens=self.tree.digest_block, unchanged=True)
        if self._digest is None or self._digest.version != version:
            hashes, truncated = self.tree.digest()  # kept as the tree changes: a copy
            dead = self.tree.dead_ends()
            if truncated:
                listed = set(hashes)
                dead = [h for h in dead if h in listed]
            self._digest = TreeDigest(
                version=version,
                block_tokens=self.tree.digest_block,
                hashes=pack(hashes),
                truncated=truncated,
                dead=pack(dead),
            )
        return self._digest

    def stats(self) -> dict[str, int | float]:
        return {
            "tree_evictable_tokens": self.tree.evictable_size,
            "tree_protected_tokens": self.tree.protected_size,
            "tree_nodes": self.tree.num_nodes,
        }
