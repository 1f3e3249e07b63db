"""Scheduler <-> allocator messages. One message carries a whole step's requests.

Slot deltas returned here are forwarded unchanged to the model runner with the
next forward batch, so its replica of the req-to-token table stays exact.
"""

from __future__ import annotations

import enum

import msgspec

from transport.messages.base import HotMessage, Message
from transport.messages.tiers import PersistedSession


class SlotDeltas(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Row writes: for each i, table[rows[i], starts[i] : starts[i] + lengths[i]] = next slots;
    with split KV pools, the new full -> sliding page mappings too."""

    rows: list[int] = []
    starts: list[int] = []
    lengths: list[int] = []
    slots: list[int] = []
    swa_full_pages: list[int] = []
    swa_pages: list[int] = []


class ExtendItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    rid: int
    tokens: list[int]  # every token known for the request (prompt, plus output after a retraction)
    budget: int  # at most this many tokens computed in this chunk
    match_prefix: bool = True  # False: compute every token (prompt logprobs need the logits)
    session_id: str = ""  # a streaming session's turn: restore its KV at admission, save at finish
    cache_salt: str = ""  # prefix-cache namespace: pages are shared only within one salt


class ExtendGrantItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    rid: int
    row: int  # -1: refused (no pages or rows even after eviction); nothing changed
    cached_len: int  # tokens served from the prefix tree at admission
    start: int
    end: int


class AllocExtend(HotMessage):
    items: list[ExtendItem]


class AllocExtendReply(HotMessage):
    grants: list[ExtendGrantItem]
    deltas: SlotDeltas


class DraftCommit(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Speculative decoding: of the slots the last step reserved for `rid`, the first
    `accepted` (>= 1) hold KV of tokens it keeps; the rest are freed (`commit_draft`)."""

    rid: int
    accepted: int


class AllocDecode(HotMessage):
    """One slot per request for its next token, plus `drafts[i]` reserved slots for its draft
    tokens (empty: none). `commits` (the previous step's) are applied first."""

    rids: list[int]
    drafts: list[int] = []
    commits: list[DraftCommit] = []


class AllocDecodeReply(HotMessage):
    short_pages: int  # 0: every request got its slot; >0: none did, this many pages missing
    deltas: SlotDeltas


class CacheUnfinished(HotMessage):
    """After a non-final prefill chunk: move its whole pages into the prefix tree."""

    rids: list[int]
    tokens: list[list[int]]


class CacheUnfinishedReply(HotMessage):
    deltas: SlotDeltas


class ReleaseKind(enum.IntEnum):
    FINISH = 0  # cache committed pages in the tree, free the rest, drop the record
    ABORT = 1  # free everything, drop the record (idempotent)
    RETRACT = 2  # cache committed pages, free the rest, keep the record for re-admission


class ReleaseItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    rid: int
    kind: ReleaseKind
    tokens: list[int] = []


class ReleaseBatch(HotMessage):
    """Releases; `commits` (speculative steps' accepted positions) are applied first, so a
    request finishing in a speculative step releases its record at rest."""

    items: list[ReleaseItem]
    commits: list[DraftCommit] = []


class KvStatsRequest(Message):
    check_invariants: bool = False
    # also `reclaimable_pages` (a walk of the prefix tree in the radix actor; 0 without it)
    reclaimable: bool = False


class KvStats(Message):
    page_size: int
    total_pages: int
    free_pages: int
    tree_pages: int
    held_pages: int  # owned by live requests
    session_pages: int
    evictable_pages: int  # tree pages no request locks
    records: int  # live request records
    held_rows: int
    cache_hit_tokens: int
    evicted_pages: int
    admitted: int
    finished: int
    aborted: int
    retracted: int
    idle_checks: int = 0  # conservation checks run when the engine went idle
    idle_check_failures: int = 0
    sessions_open: int = 0  # session slots (open sessions)
    session_slots: int = 0  # session slots holding KV
    session_hit_tokens: int = 0  # tokens restored from session slots at admission
    swa_total_pages: int = 0  # the sliding layers' pool (0: they share the full pool)
    swa_free_pages: int = 0
    swa_freed_pages: int = 0  # sliding pages freed because the window had passed them
    # prompts keep their sliding KV (kv.swa_free_prompt false): a request's sliding need
    # is its prompt plus a window, not a window alone
    swa_keeps_prompt: bool = False
    session_reclaims: int = 0  # idle session slots released to the tree (cap or pressure)
    # pages a request may take from idle sessions: their slots' own pages and the tree
    # pages only they lock (the ledger releases the slots under pressure); asked for with
    # `KvStatsRequest.reclaimable` (or `check_invariants`), else 0
    reclaimable_pages: int = 0
    tree_heals: int = 0  # dead (window-freed) tree pages replaced by live ones
    session_demotes: int = 0  # idle sessions' KV copied to the host tier
    session_promotes: int = 0  # session turns that loaded their history from it
    promoted_tokens: int = 0  # positions loaded from it (not prefilled)
    tier_drops: int = 0  # host-tier entries dropped to fit its budget
    tier_failures: int = 0  # copies the runner failed (the turn prefilled instead)
    host_tier_budget: int = 0  # bytes (0: no host tier)
    host_tier_bytes: int = 0
    host_tier_entries: int = 0  # sessions' entries
    stored_tokens: int = 0  # positions whose KV the tiers hold
    disk_tier_budget: int = 0  # bytes (0: no disk tier)
    disk_tier_bytes: int = 0
    disk_tier_entries: int = 0  # sessions' entries
    tier_spills: int = 0  # host-tier entries moved to the disk tier
    disk_promotes: int = 0  # session turns that loaded their history from the disk tier
    prefix_blocks: int = 0  # evicted prefix-tree blocks the tiers keep
    block_demotes: int = 0  # evicted prefix-tree blocks copied to the host tier
    block_promotes: int = 0  # admissions that loaded prefix blocks
    block_loaded_tokens: int = 0  # positions loaded from prefix blocks (not prefilled)
    disk_reads_ahead: int = 0  # session turns whose disk KV was read beside the steps first
    disk_tier_writing: int = 0  # disk-tier entries whose file is being written


class OpenSlot(Message):
    """Sessions -> allocator: a new session (its slot holds nothing yet), with the client's
    hints (`OpenSession`)."""

    session_id: str
    priority: int = 0
    retain_s: float = 0.0


class CloseSlots(Message):
    """Sessions -> allocator: release these sessions' KV (a running turn's at its end)."""

    session_ids: list[str]


class CloseSlotsReply(Message):
    pages: int  # pages the released slots held


class PersistSlots(Message):
    """Sessions -> allocator on drain: write these idle sessions' KV to the disk tier and
    record them so a restart finds them (`transport.messages.tiers.PersistedSession`)."""

    sessions: list[PersistedSession]


class PersistSlotsReply(Message):
    persisted: int


class RestoreSlots(Message):
    """Sessions -> allocator at start: the sessions a previous run persisted."""


class RestoreSlotsReply(Message):
    sessions: list[PersistedSession]


class OffloadSlot(Message):
    """Sessions -> allocator: demote this idle session's KV out of the pool now."""

    session_id: str


class PrefetchSlot(Message):
    """Sessions -> allocator: load this idle session's KV from its tier into the pool now."""

    session_id: str


class PrefetchSlotReply(Message):
    pool_tokens: int  # positions the pool holds for it now (0: nothing loaded)


class OffloadSlotReply(Message):
    pages: int  # pool pages the slot gave back
    stored_tokens: int  # positions the host tier holds for it now (0: no tier, or failed)


class SlotStatsRequest(Message):
    session_id: str


class SlotStats(Message):
    held_tokens: int  # tokens whose KV the session holds now (pool or tiers)
    pool_tokens: int = 0  # of them, in the pool


class IdleCheck(Message):
    """Scheduler -> allocator when the engine goes idle: check that nothing is held."""


class DropCache(Message):
    """Scheduler -> allocator after the runner lost its KV (it restarted): evict the whole
    prefix tree. Refused while any request holds KV."""


class DropCacheReply(Message):
    dropped_pages: int
    problems: list[str]  # the idle check right after: [] when every page is free again


class IdleCheckReply(Message):
    problems: list[str]  # empty: every page is free or in the tree, no record, row or lock


class StageSlot(Message):
    """Scheduler -> allocator: a turn of this session arrived; if its idle KV is on the
    disk tier, have the runner read it ahead (answered once read, or at once when there is
    nothing to read). The turn waits for the answer while other requests run."""

    session_id: str


class StageSlotReply(Message):
    staged: bool  # a disk entry was read ahead for it
