"""Allocator (and scheduler) <-> radix cache actor messages.

Only the allocator sends the mutating ones (match-and-lock, insert, unlock,
evict): every page transfer between the tree and the pool is one call, so it is
atomic from the allocator's mailbox. `PeekPrefix` is read-only (scheduling policy).
"""

from __future__ import annotations

from transport.messages.base import HotMessage, Message


class MatchAndLock(HotMessage):
    tokens: list[int]


class MatchReply(HotMessage):
    length: int
    slots: list[int]
    node_id: int


class InsertPrefix(HotMessage):
    tokens: list[int]
    slots: list[int]
    unlock_node: int = -1  # -1: none
    lock_new: bool = False
    alive: list[bool] = []  # per page: its sliding KV exists ([]: every page's does)
    need_alive_from: int = -1  # -1: none (see `RadixTree.insert`)


class InsertReply(HotMessage):
    existing_len: int
    node_id: int
    slots: list[int]
    length: int
    released: list[int] = []  # slots of healed dead pages: the allocator frees them


class UnlockNode(HotMessage):
    node_id: int


class EvictPages(HotMessage):
    num_pages: int


class EvictReply(HotMessage):
    pages: list[int]


class UnlockablePages(HotMessage):
    """The pages that releasing one lock on each of `node_ids` would make evictable
    (`RadixTree.pages_freed_by_unlocking`); changes nothing."""

    node_ids: list[int]


class UnlockablePagesReply(HotMessage):
    pages: list[int]


class EvictBlocks(HotMessage):
    """`EvictPages`, answered with each evicted node (a tier below the pool keeps copies)."""

    num_pages: int


class EvictedBlocks(HotMessage):
    starts: list[int]  # node i's KV is of positions [starts[i], len(keys[i]))
    keys: list[list[int]]  # the whole path's tokens from the root
    slots: list[list[int]]
    alive: list[list[bool]]


class PeekPrefix(HotMessage):
    """Matched length per token list, without locking (may still split nodes)."""

    tokens: list[list[int]]


class PeekReply(HotMessage):
    lengths: list[int]


class TreeStatsRequest(Message):
    with_pages: bool = False


class TreeSnapshotRequest(Message):
    """The whole tree, for the invariant checker (debug checks only: it is large)."""


class TreeSnapshotReply(Message):
    ids: list[int]
    parents: list[int]
    keys: list[list[int]]
    values: list[list[int]]
    lock_refs: list[int]
    evictable_tokens: int
    protected_tokens: int
    alive: list[list[bool]] = []


class TreeStats(Message):
    evictable_tokens: int
    protected_tokens: int
    nodes: int
    pages: list[int] = []


class TreeDigestRequest(Message):
    """The tree's cached prefixes as hashes (`kvcore.prefix_digest`), for a router.
    `since`: the version the asker holds; an unchanged tree answers without the hashes."""

    since: int = -1


class TreeDigest(Message):
    version: int
    block_tokens: int
    unchanged: bool = False
    hashes: bytes = b""  # little-endian uint64s, parents before children
    truncated: bool = False  # the tree holds more than a digest lists
    # Of `hashes`, the dead ends (`RadixTree.dead_ends`: no request resumes right after
    # them, their sliding window's KV is gone), little-endian uint64s
    dead: bytes = b""
