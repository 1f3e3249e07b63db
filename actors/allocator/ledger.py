"""The allocator's core: the only code that writes `ReqKvInfo` fields.

`KvLedger` owns every request's record, the page pool and the req-to-token
rows. It reaches the prefix tree only through a `PrefixPort`. All methods run
inside the allocator actor's mailbox, one at a time; each leaves the state
consistent (the invariant checker may run after any of them).

Row ranges a request owns, for a held record `r` with row R:
    R[0 : r.cache_protected_len)                    tree pages, locked by this request
    R[r.cache_protected_len : r.kv_allocated_len)   the request's own pages (whole pages)
Allocation commits: the call that reserves slots for an extend or a decode
step also advances kv_committed_len, except for speculative decoding: a decode step with
draft tokens reserves their slots (`alloc_decode` with `drafts`: kv_allocated_len moves,
kv_committed_len does not), and `commit_draft` then commits the accepted positions and frees
the rejected tail. A record is at rest (committed == allocated) at every release point:
finish, retraction and a session save refuse a record with uncommitted draft slots; only
an abort frees one as it is.

Streaming sessions: a `SessionSlot` holds a finished turn's whole record (row, tree lock
and pages, the partial last page included), pinned: nothing evicts it. Ownership moves, it
is never shared: the admission of the session's next turn moves the record into the
request (trimming the tail past the longest common prefix with the new prompt, page-aligned)
and the turn's finish moves it back. An admission is all or nothing, so a refused or retried
turn finds the slot as it was. While a turn runs the slot holds nothing, so the checker
counts those pages once, as the request's. An abort or retraction of the turn frees its KV
as for any request: the slot stays empty and the next turn prefills from the prefix tree.

Sessions may pin at most `session_max_pages` pages (`pinned_pages`: their own, and the tree
pages only idle slots lock, as the chunks a long turn's prefill cached): past it, and
whenever an allocation needs pages that neither the free list nor the tree's evictable
pages cover, the least recently used idle slot is released to the prefix tree (its pages
become cached, evictable KV; its next turn prefills what the tree no longer holds). A
request never waits behind idle sessions.

The host tier (with `tiers` and `host`): reclaiming an idle slot first demotes it. Its
history's KV is copied out of the pool under a new handle (`TierEntry`, owned by the slot:
the slot then holds no record, no row and no page); its own pages are freed (the tree part
it had locked stays the tree's), so nothing is held twice. The session's next turn
promotes it: the admission matches the prefix tree as any request does, loads the
positions the tree lacks from the entry into the pages it reserves, and computes only the
new tokens; the entry is dropped either way (the KV is in the pool again, or the
conversation diverged). The host tier's entries fit its byte budget: the
least recently used move to the disk tier (`disk`, files the runner writes and checksums)
or, without one, are dropped (that session prefills what the tree lost); the disk tier's
overflow is dropped. A failed copy falls back to the pool-only behaviour: a failed save
keeps nothing, a failed spill drops, a failed load (a missing, truncated or foreign file
included) prefills.

A spill is two-phase where the ledger has `spill_later` (the allocator actor sets it): the
entry moves to the disk tier's accounting at once, under `writing` (its host size), and the
runner writes the file beside the steps; `spill_done` then sets the file's size (or drops
the entry if the write failed). Meanwhile the runner's store still holds the host copy, so
a load or drop of a writing entry works as on the host tier, and the store audit accepts
either place for it. Writes in flight hold at most the host budget and MAX_WRITING_BYTES
(always one): past it a spill waits for its file, as without `spill_later`.

Prefix-tree blocks below the pool (with `prefix_blocks`, a `PrefixIndex`): a tree node the
pool evicts is copied to the host tier first, as far as its pages have their sliding KV,
and the index owns the copy. An admission whose session has nothing to load continues the
tree's match with the blocks that hold the next pages of its tokens, loading them into the
pages it reserves, as a promotion does. A loaded block stays stored (the next eviction of
the same pages copies nothing); blocks and sessions' entries share the tiers' budgets, but
a block no admission has loaded leaves the tiers before any session's entry (dropped, not
written to disk).

Prefix-cache namespaces: a request's `cache_salt` turns its token ids into keys of their
own (`kvcore.salt`) before anything compares them for reuse (the tree, session slots).

Sliding-window pages in the tree: a tree page whose sliding KV was freed is dead (the
tree records it per page). A request never takes a dead tree page into the part of its row
that its future queries' window reads: the admission match is cut before such a window,
and a chunk's `cache_unfinished` stops where the tree would hand one over. A finishing or
chunked request whose own page is alive heals the tree's dead page in its place.

Slot deltas: every change to a row is returned as (row, start, slots) so the
model runner can mirror the table on its device; every change to the sliding page map
(new mappings, and unmappings as page 0) too, in order. Unmappings made by operations that
reply with no deltas (finish, abort, retract, session close, drop) go out at the front of
the next operation that does, before any new mapping.

Every public method runs inside `ledger_writes()`: with the write guard on, a record
written anywhere else raises.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from actors.allocator.prefix_port import PrefixPort
from actors.allocator.tier_port import TierPort
from kvcore import (
    KvSnapshot,
    PagePool,
    ReqKvInfo,
    ReqToTokenTable,
    SwaPages,
    ceil_page,
    check_idle,
    check_invariants,
    floor_page,
    pages_of_slots,
    slots_of_pages,
    swa_idle_problems,
)
from kvcore.radix_tree import EvictedBlock
from kvcore.req_kv_info import ledger_writes
from kvcore.salt import salted_tokens
from kvcore.tiers import (
    BlockLoad,
    KvTier,
    PrefixIndex,
    Promotion,
    TierEntry,
    TierViolation,
    check_tiers,
    plan_block_loads,
    plan_promotion,
)


def _ledger_op(fn):
    """Run a ledger method inside `ledger_writes()` (the only context that writes records).
    A method that takes `deltas` ends, on every path, with the sliding pages it (or an
    earlier operation) unmapped appended to them for the runner."""
    signature = inspect.signature(fn)
    takes_deltas = "deltas" in signature.parameters
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args, **kwargs):
            with ledger_writes():
                if not takes_deltas:
                    return await fn(*args, **kwargs)
                deltas = signature.bind(*args, **kwargs).arguments["deltas"]
                pending = args[0]._send_pending(deltas)
                try:
                    return await fn(*args, **kwargs)
                except BaseException:
                    # The caller drops a failed operation's deltas: resend these next time.
                    args[0]._pending[:0] = pending
                    raise
                finally:
                    args[0]._send_unmapped(deltas)

        return run_async

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with ledger_writes():
            return fn(*args, **kwargs)

    return run


# Host copies of disk-tier entries whose files are being written, at most (past the first):
# memory above the host tier's budget, and a queue each write waits behind.
MAX_WRITING_BYTES = 256 << 20


class LedgerError(Exception):
    """A request the ledger cannot honour (unknown rid, context overflow, misuse)."""


@dataclass(frozen=True, slots=True)
class SlotDelta:
    row: int
    start: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class SwaMapDelta:
    """New sliding pages: the runner's map gets map[full_pages[i]] = swa_pages[i]."""

    full_pages: np.ndarray
    swa_pages: np.ndarray


@dataclass(frozen=True, slots=True)
class ExtendGrant:
    rid: int
    row: int
    cached_len: int  # tokens matched from the prefix tree at admission (0 on later chunks)
    start: int  # first position computed by this extend (== previous committed length)
    end: int  # new committed length


@dataclass(slots=True)
class SessionSlot:
    """A session's KV between turns. `rec` (None: nothing held) has KV for `tokens`."""

    rec: ReqKvInfo | None = None
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    turn: int | None = None  # the request running this session's current turn
    close_pending: bool = False  # closed during a turn: released when the turn ends
    last_used: int = 0  # ledger clock at the last save or restore (LRU reclaim order)
    stored: int | None = None  # the handle of its KV in the host tier (then `rec` is None)
    # The client's hints: a lower priority leaves the pool (and the tiers) first; for
    # `retain_s` after each turn its KV is dropped from the tiers only when nothing else is
    # left to drop (time.monotonic() deadline in `retain_until`).
    priority: int = 0
    retain_s: float = 0.0
    retain_until: float = 0.0


@dataclass(slots=True)
class LedgerCounters:
    evicted_pages: int = 0
    cache_hit_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    retracted: int = 0
    session_hit_tokens: int = 0  # tokens restored from session slots at admission
    session_saves: int = 0
    swa_freed_pages: int = 0  # sliding pages freed because the window had passed them
    session_reclaims: int = 0  # idle session slots released to the tree (cap or pressure)
    tree_heals: int = 0  # dead tree pages replaced by a request's live ones
    session_demotes: int = 0  # idle session slots copied to the host tier
    session_promotes: int = 0  # session turns that loaded their history from a tier
    promoted_tokens: int = 0  # positions loaded from a tier
    disk_promotes: int = 0  # of the promotions, those from the disk tier
    tier_spills: int = 0  # host-tier entries moved to the disk tier to fit the host budget
    tier_drops: int = 0  # entries dropped to fit a budget (the disk's, or the host's alone)
    tier_failures: int = 0  # saves or loads the runner failed (fell back to prefill)
    block_demotes: int = 0  # evicted prefix-tree blocks copied to the host tier
    block_demote_skips: int = 0  # evicted blocks a stored block already held
    block_promotes: int = 0  # admissions that loaded prefix blocks from a tier
    block_loaded_tokens: int = 0  # positions loaded from prefix blocks


@dataclass
class KvLedger:
    pool: PagePool
    table: ReqToTokenTable
    tree: PrefixPort | None  # None: prefix caching disabled
    records: dict[int, ReqKvInfo] = field(default_factory=dict)
    lock_nodes: dict[int, int] = field(default_factory=dict)  # rid -> locked tree node
    slots: dict[str, SessionSlot] = field(default_factory=dict)  # session id -> its slot
    session_lock_nodes: dict[str, int] = field(default_factory=dict)  # sid -> locked node
    turn_session: dict[int, str] = field(default_factory=dict)  # rid -> session of its turn
    # Sliding-window layers' pool (None: they share the full pool's slots, nothing is freed
    # early) and their window in tokens; pages are freed in steps of `swa_free_step` tokens.
    swa: SwaPages | None = None
    window: int = 0
    swa_free_step: int = 64
    # False: a request's prompt keeps its sliding KV (swa_evict_floor = prompt length), so
    # every prefix of it stays reusable from the tree; only output the window has passed is
    # freed. True: the prompt's too (the most memory; a prefix hit is then cut to where its
    # last window is intact), and prefill chunks stay the request's until it ends.
    swa_free_prompt: bool = False
    # Pages idle session slots may pin together, their own and the tree pages only they
    # lock (None: no cap besides the pool).
    session_max_pages: int | None = None
    # The host tier below the pool (None: an idle slot's KV only goes to the tree).
    tiers: TierPort | None = None
    host: KvTier | None = None
    disk: KvTier | None = None  # below the host tier (None: its overflow is dropped)
    entry_session: dict[int, str] = field(default_factory=dict)  # handle -> its session
    # Evicted prefix-tree blocks kept in the tiers (None: eviction forgets them; needs
    # `tiers` and `host`).
    prefix_blocks: PrefixIndex | None = None
    counters: LedgerCounters = field(default_factory=LedgerCounters)
    salts: dict[int, str] = field(default_factory=dict)  # rid -> its cache_salt (if any)
    # full pages unmapped from the sliding pool and not yet sent to the runner
    _unmapped: list[np.ndarray] = field(default_factory=list)
    # deltas of an operation that replies with none (a prefetch), sent first with the next
    _pending: list = field(default_factory=list)
    _clock: itertools.count = field(default_factory=lambda: itertools.count(1))
    _restoring: str | None = None  # the session whose slot an admission is moving now
    # The entries an admission is loading now (never moved nor dropped meanwhile).
    _promoting: frozenset[int] = frozenset()
    # Two-phase spills (module docstring): starts the runner's write of a disk-tier entry
    # and has `spill_done` called with the result (None: each spill waits for its file).
    spill_later: Callable[[int], None] | None = None
    writing: dict[int, int] = field(default_factory=dict)  # handle -> its host bytes
    # Tier handles, unique per process (a restarted allocator never reuses a live one).
    _handles: itertools.count = field(
        default_factory=lambda: itertools.count(secrets.randbits(40) << 8)
    )

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    # ---- lifecycle of the record ---------------------------------------------------------
    def forget(self, rid: int) -> None:
        """Drop a finished request's record; it must hold nothing."""
        rec = self.records.get(rid)
        if rec is not None and rec.is_held:
            raise LedgerError(f"request {rid} still holds row {rec.req_pool_idx}")
        self.records.pop(rid, None)
        self.salts.pop(rid, None)

    def _keys(self, rid: int, tokens: np.ndarray) -> np.ndarray:
        """The request's tokens as prefix-cache keys (its salt's namespace)."""
        return salted_tokens(tokens, self.salts.get(rid, ""))

    # ---- extend (admission and prefill chunks) -------------------------------------------
    @_ledger_op
    async def alloc_extend(
        self,
        rid: int,
        tokens: np.ndarray,
        budget: int,
        deltas: list[SlotDelta],
        match_prefix: bool = True,
        session: str = "",
        cache_salt: str = "",
    ) -> ExtendGrant | None:
        """Reserve and commit KV for the next prefill chunk of `rid` (at most `budget` tokens).

        `tokens` are all tokens known for the request (prompt, plus output after a
        retraction). A request not holding a row is admitted: prefix match (leaving at
        least one token to compute), row, slots. Returns None, changing nothing, when pages
        or rows run out even after eviction. `match_prefix=False` skips the prefix tree at
        admission (every token is computed; prompt logprobs need their logits).

        With `session`, an admission restores that session's slot when its KV shares a
        prefix with `tokens` (module docstring); a slot it cannot reuse (the prompt diverges
        inside the slot's tree-protected prefix, or every token must be computed) is
        released to the prefix tree first.
        """
        self.check_extend(rid, len(tokens), budget)
        total = len(tokens)
        rec = self.records.get(rid)
        admitting = rec is None or not rec.is_held
        if admitting:
            if cache_salt:
                self.salts[rid] = cache_salt
            else:
                self.salts.pop(rid, None)
        tokens = self._keys(rid, tokens)
        if admitting and session:
            slot = self.slots.get(session)
            if slot is not None and slot.rec is not None:
                usable = 0
                if match_prefix and total > 1:
                    usable = common_prefix_len(slot.tokens, tokens[: total - 1])
                # The first computed position reads its window: the window never freed any of
                # it (the record's cursor stays inside what the restore keeps), and every page
                # of it, the tree prefix's too, still has its sliding KV.
                first_read = max(usable - self.window + 1, 0)
                swa_ok = slot.rec.swa_evicted_seqlen <= first_read and self._window_alive(
                    slot.rec, usable
                )
                if usable and usable >= slot.rec.cache_protected_len and swa_ok:
                    return await self._restore(rid, session, slot, usable, tokens, budget, deltas)
                await self._release_slot_kv(session, slot, cache=True)
        cached, node, prefix_slots = 0, None, None
        need_row = admitting and self.table.num_free_rows == 0
        if need_row and not self._idle_slots():
            return None
        promotion: Promotion | None = None
        loads: list[BlockLoad] = []
        if admitting:
            if self.tree is not None and total > 1 and match_prefix:
                cached, node, prefix_slots = await self._match_and_lock(tokens[: total - 1])
            start = cached
            if session:
                promotion = await self._plan_promotion(session, tokens, cached, match_prefix)
                if promotion is not None:
                    start = promotion.length  # [cached, start) is loaded, not computed
            if promotion is None and self.prefix_blocks is not None and match_prefix:
                loads = plan_block_loads(
                    self.prefix_blocks, self._entry_or_none, tokens[: total - 1], cached
                )
                if loads:
                    start = loads[-1].end  # [cached, start) is loaded, not computed
        else:
            start = rec.kv_committed_len
        end = min(total, start + budget)
        alloc_from = cached if admitting else start  # new slots from here
        row_tail = None if admitting else self._last_slot(rec)
        if promotion is not None:
            self._promoting = frozenset([self.slots[session].stored])
        else:
            self._promoting = frozenset(load.handle for load in loads)
        try:
            if need_row:
                # An idle session gives up its row only for an admission that then fits.
                if await self._shortfall(self._pages_for(alloc_from, end, open_page=False)):
                    if node is not None:
                        await self.tree.unlock(node)
                    return None
                await self._reclaim_session()
            new_slots = await self._reserve_slots(alloc_from, end, row_tail, deltas)
        finally:
            self._promoting = frozenset()
        if new_slots is None:
            if node is not None:
                await self.tree.unlock(node)
            return None
        unused = self.slots.get(session) if admitting and session else None
        if promotion is None and unused is not None and unused.stored is not None:
            # Granted without it: the entry is of no use to this conversation any more.
            await self._drop_entry(unused.stored)
        loaded = start
        if promotion is not None and not await self._load_entry(
            session, cached, promotion, new_slots
        ):
            promotion, loaded = None, cached
        if loads:
            loaded = await self._load_blocks(loads, cached, new_slots)
        if loaded < start:
            # A load failed: compute those positions instead, within the budget.
            keep_end = min(end, loaded + budget)
            extra = new_slots[ceil_page(keep_end - cached, self.page_size) :]
            if extra.size:
                self._free_pages(pages_of_slots(extra, self.page_size))
            new_slots = new_slots[: keep_end - cached]
            start, end = loaded, keep_end
        if admitting:
            # The record exists only once the request holds something (a refusal leaves none).
            if rec is None:
                rec = self.records[rid] = ReqKvInfo()
            row = self.table.alloc_row()
            assert row is not None  # a row was free, or an idle session gave its own back
            rec.req_pool_idx = row
            rec.cache_protected_len = cached
            if promotion is not None and promotion.dead_to > promotion.dead_from:
                # The loaded history's freed sliding range, as its record had it.
                rec.swa_evict_floor = promotion.dead_from
                rec.swa_evicted_seqlen = promotion.dead_to
            elif self.swa is not None and not self.swa_free_prompt:
                rec.swa_evict_floor = total
            if cached:
                self.table.write(row, 0, prefix_slots)
                deltas.append(SlotDelta(row, 0, prefix_slots))
                self.lock_nodes[rid] = node
                self.counters.cache_hit_tokens += cached
            self.counters.admitted += 1
            if session:
                self._start_turn(rid, session)
        row = rec.req_pool_idx
        self.table.write(row, alloc_from, new_slots)
        deltas.append(SlotDelta(row, alloc_from, new_slots))
        rec.kv_allocated_len = end
        rec.kv_committed_len = end
        self._free_window(rec, first_query=start)
        return ExtendGrant(rid, row, start if admitting else 0, start, end)

    async def _match_and_lock(self, keys: np.ndarray) -> tuple[int, int | None, np.ndarray]:
        """The tree's longest usable prefix of `keys`, locked: (length, node, slots); (0,
        None, none) when nothing matched. Where the window before the matched end lost its
        sliding KV, the match is cut there (the rest is recomputed)."""
        match = await self.tree.match_and_lock(keys)
        usable = self._swa_usable(match.slots, match.length)
        if usable < match.length:
            await self.tree.unlock(match.node_id)
            match = await self.tree.match_and_lock(keys[:usable])
        if not match.length:
            return 0, None, _NO_PAGES
        return match.length, match.node_id, match.slots

    async def _restore(
        self,
        rid: int,
        session: str,
        slot: SessionSlot,
        usable: int,
        tokens: np.ndarray,
        budget: int,
        deltas: list[SlotDelta],
    ) -> ExtendGrant | None:
        """Admit `rid` on its session's KV: keep [0, usable), free the slot's pages past
        ceil_page(usable), compute from `usable`. None, changing nothing, if it cannot fit."""
        ps = self.page_size
        rec = slot.rec
        row = rec.req_pool_idx
        keep = ceil_page(usable, ps)
        tail = self.table.read(row, keep, max(rec.kv_allocated_len, keep))
        tail_pages = pages_of_slots(tail, ps) if tail.size else tail
        end = min(len(tokens), usable + budget)
        need = self._pages_for(usable, end, open_page=usable % ps != 0)
        self._restoring = session  # not an idle slot to reclaim while it is being restored
        try:
            if await self._shortfall(need, returning=len(tail_pages)):
                return None
            if len(tail_pages):
                self._free_pages(tail_pages)
            last = int(self.table.table[row, usable - 1])
            new_slots = await self._reserve_slots(usable, end, last, deltas)
        finally:
            self._restoring = None
        assert new_slots is not None  # budgeted above, and only this mailbox allocates
        self._move_slot_to_request(session, slot, rid)
        # The prompt keeps its sliding KV, unless the window already freed some of this
        # record's (the floor never covers freed KV: [floor, evicted) is the freed range).
        if self.swa is not None and not self.swa_free_prompt and rec.swa_evicted_seqlen == 0:
            rec.swa_evict_floor = len(tokens)
        self._start_turn(rid, session)
        self.table.write(row, usable, new_slots)
        deltas.append(SlotDelta(row, usable, new_slots))
        rec.kv_allocated_len = end
        rec.kv_committed_len = end
        self.counters.admitted += 1
        self.counters.session_hit_tokens += usable
        self._free_window(rec, first_query=usable)
        return ExtendGrant(rid, row, usable, usable, end)

    # ---- record transfers between a request and a session slot (the audit lists both) -----
    def _move_slot_to_request(self, session: str, slot: SessionSlot, rid: int) -> None:
        """The slot's record (row, pages, tree lock) becomes request `rid`'s; the slot keeps
        no reference. A released record the request kept after a retraction is replaced."""
        rec = slot.rec
        self.records[rid] = rec
        slot.rec = None
        slot.tokens = np.zeros(0, dtype=np.int64)
        slot.last_used = next(self._clock)
        node = self.session_lock_nodes.pop(session, None)
        if node is not None:
            self.lock_nodes[rid] = node

    def _move_request_to_slot(self, rid: int, session: str, slot: SessionSlot, tokens) -> None:
        """Request `rid`'s held record (row, pages, tree lock) becomes the slot's, with the
        keys of its committed tokens; the request keeps nothing."""
        rec = self.records.pop(rid)
        slot.rec = rec
        slot.tokens = np.array(tokens[: rec.kv_committed_len], dtype=np.int64)
        slot.turn = None
        slot.last_used = next(self._clock)
        slot.retain_until = time.monotonic() + slot.retain_s
        node = self.lock_nodes.pop(rid, None)
        if node is not None:
            self.session_lock_nodes[session] = node

    def _start_turn(self, rid: int, session: str) -> None:
        slot = self.slots.setdefault(session, SessionSlot())
        slot.turn = rid
        self.turn_session[rid] = session

    def check_extend(self, rid: int, total: int, budget: int) -> None:
        """Raise `LedgerError` if an extend of `rid` to `total` tokens is misuse (checked for
        every item of a message before any is applied)."""
        if budget < 1:
            raise LedgerError(f"request {rid}: extend budget must be >= 1")
        if total > self.table.row_capacity:
            raise LedgerError(f"request {rid}: {total} tokens exceed row capacity")
        rec = self.records.get(rid)
        if rec is not None and rec.is_held and rec.kv_committed_len >= total:
            raise LedgerError(f"request {rid}: nothing left to extend")

    # ---- decode --------------------------------------------------------------------------
    @_ledger_op
    async def alloc_decode(
        self, rids: list[int], deltas: list[SlotDelta], drafts: list[int] | None = None
    ) -> int:
        """One slot for each request's next token, all or nothing; with `drafts`, also
        `drafts[i]` slots for request i's draft tokens (speculative decoding).

        A request without drafts commits its slot at once (allocation commits). A request
        with k > 0 drafts has 1 + k slots reserved: kv_allocated_len moves by 1 + k and
        kv_committed_len stays until `commit_draft` says how many positions were accepted.
        Returns 0 on success, else the number of pages still missing after eviction
        (nothing changed; the scheduler drops the drafts, or retracts, and retries). With
        drafts nothing is evicted: the pages must be free already.
        """
        ps = self.page_size
        recs = self.check_decode(rids, drafts)
        drafting = drafts is not None and any(drafts)
        if not drafting:
            drafts = [0] * len(recs)
        need = sum(
            self._pages_for(r.kv_allocated_len, r.kv_allocated_len + 1 + k, open_page=True)
            for r, k in zip(recs, drafts)
        )
        if drafting:
            # Draft slots are a guess: they take free pages only, never cached KV (evicted
            # from the tree) nor an idle session's (released); short, the scheduler retries
            # without them.
            short = max(need - self.pool.num_free, need - self.swa.num_free if self.swa else 0)
        else:
            short = await self._ensure_free(need)
        if short > 0:
            return short
        fresh = self._alloc_pages(need, deltas)
        used = 0
        for rec, k in zip(recs, drafts):
            pos, row = rec.kv_allocated_len, rec.req_pool_idx
            n = 1 + k
            in_open = min(n, ps - pos % ps) if pos % ps else 0
            pages = ceil_page(n - in_open, ps) // ps
            slots = slots_of_pages(fresh[used : used + pages], ps)[: n - in_open]
            used += pages
            if in_open:
                last = int(self.table.table[row, pos - 1])
                head = np.arange(last + 1, last + 1 + in_open, dtype=np.int64)
                slots = np.concatenate([head, slots]) if slots.size else head
            self.table.write(row, pos, slots)
            deltas.append(SlotDelta(row, pos, slots))
            rec.kv_allocated_len = pos + n
            if k == 0:
                rec.kv_committed_len = pos + 1
            # Every record keeps the window of its last committed position (the checker's
            # bound, kv_committed_len - window on): with drafts reserved that is pos - 1
            # until the commit.
            self._free_window(rec, first_query=rec.kv_committed_len - 1)
        return 0

    def check_decode(
        self,
        rids: list[int],
        drafts: list[int] | None = None,
        committing: Mapping[int, int] | None = None,
    ) -> list[ReqKvInfo]:
        """The held records of `rids`; raises `LedgerError` on misuse, changing nothing.
        `committing` (rid -> accepted positions) are commits the same message applies
        first: those records are checked as they will be."""
        _require_unique(rids)
        if drafts is not None and len(drafts) != len(rids):
            raise LedgerError(f"{len(drafts)} draft counts for {len(rids)} requests")
        committing = committing or {}
        recs = [self._held(rid) for rid in rids]
        for i, (rid, rec) in enumerate(zip(rids, recs)):
            k = drafts[i] if drafts is not None else 0
            if k < 0:
                raise LedgerError(f"request {rid}: negative draft count {k}")
            length = rec.kv_allocated_len
            if rid in committing:
                length = rec.kv_committed_len + committing[rid]
            elif rec.kv_committed_len < rec.kv_allocated_len:
                raise LedgerError(
                    f"request {rid}: {rec.kv_allocated_len - rec.kv_committed_len} draft "
                    "slots not committed yet"
                )
            if length + 1 + k > self.table.row_capacity:
                raise LedgerError(f"request {rid}: context full ({length} + {1 + k} slots)")
        return recs

    @_ledger_op
    async def commit_draft(self, rid: int, accepted: int) -> None:
        """Speculative decoding's commit: of the positions `alloc_decode` reserved for
        `rid`'s step, the first `accepted` (>= 1: the step's input token, then the drafts
        the model accepted) hold KV of tokens the request keeps. kv_committed_len advances
        by `accepted`, the rejected tail's whole pages go back to the pool (the page holding
        the last committed position stays the row's), and kv_allocated_len falls back to
        kv_committed_len. Misuse raises `LedgerError`, changing nothing."""
        rec = self.check_commit(rid, accepted)
        end = rec.kv_committed_len + accepted
        keep = ceil_page(end, self.page_size)
        if rec.kv_allocated_len > keep:
            tail = self.table.read(rec.req_pool_idx, keep, rec.kv_allocated_len)
            self._free_pages(pages_of_slots(tail, self.page_size))
        rec.kv_committed_len = end
        rec.kv_allocated_len = end

    def check_commit(self, rid: int, accepted: int) -> ReqKvInfo:
        """The record of `rid` if committing `accepted` positions is valid; else
        `LedgerError`, changing nothing."""
        rec = self._held(rid)
        reserved = rec.kv_allocated_len - rec.kv_committed_len
        if reserved == 0:
            raise LedgerError(f"request {rid} has no draft slots to commit")
        if not 1 <= accepted <= reserved:
            raise LedgerError(
                f"request {rid}: {accepted} accepted positions, {reserved} were reserved"
            )
        return rec

    def require_at_rest(self, rid: int, committing: Mapping[int, int] | None = None) -> None:
        """A release point that keeps KV (finish, retraction, session save) needs every
        reserved draft slot committed first (or by a commit in `committing`, which the same
        message applies before the release)."""
        rec = self.records.get(rid)
        if committing and rid in committing:
            return
        if rec is not None and rec.kv_committed_len < rec.kv_allocated_len:
            raise LedgerError(
                f"request {rid}: {rec.kv_allocated_len - rec.kv_committed_len} draft slots "
                "not committed; commit_draft first"
            )

    # ---- chunked prefill: cache the finished pages of an unfinished request --------------
    @_ledger_op
    async def cache_unfinished(self, rid: int, tokens: np.ndarray, deltas: list[SlotDelta]) -> None:
        """Insert the committed whole pages into the tree and move the lock there.

        Where the tree already had a page, the row takes the tree's (ours is freed), except
        a dead tree page inside the window the next chunk reads: the tree heals it with
        ours when nobody locks it, else the insert stops before it (our pages from there
        stay ours)."""
        rec = self._held(rid)
        if self.tree is None or (self.swa is not None and self.swa_free_prompt):
            return  # (prefill chunks stay the request's: the window may free them)
        ps = self.page_size
        aligned = floor_page(rec.kv_committed_len, ps)
        if aligned <= rec.cache_protected_len:
            return
        row = rec.req_pool_idx
        slots = self.table.read(row, 0, aligned)
        need_alive_from = None
        if self.swa is not None and self.window:
            # Sliding KV stays alive from the window of the last computed position on
            # (kv_committed_len - window): the next chunk's first query reads one position
            # less, and the checker holds every holder to this bound.
            need_alive_from = floor_page(max(rec.kv_committed_len - self.window, 0), ps)
        res = await self.tree.insert(
            self._keys(rid, tokens)[:aligned],
            slots,
            unlock_node=self.lock_nodes.get(rid),
            lock_new=True,
            alive=self._alive(slots),
            need_alive_from=need_alive_from,
        )
        protected, length = rec.cache_protected_len, res.length
        if length <= protected:
            return  # the lock stayed where it was (relocking the same node)
        self.lock_nodes[rid] = res.node_id
        self._take_tree_pages(row, slots[protected:length], res, protected, deltas)
        rec.cache_protected_len = length

    def _take_tree_pages(self, row: int | None, mine, res, start: int, deltas) -> None:
        """After an insert of positions [start, start + len(mine)) whose tree slots are in
        `res.slots`: free our pages the tree already had (they differ from the tree's), free
        the dead pages the insert healed, and (with a row) point the row at the tree's."""
        theirs = res.slots[start : start + len(mine)]
        differ = mine != theirs
        if differ.any():
            self._free_pages(pages_of_slots(mine[differ], self.page_size))
            if row is not None:
                self.table.write(row, start, theirs)
                deltas.append(SlotDelta(row, start, theirs))
        if res.released.size:
            self._free_pages(pages_of_slots(res.released, self.page_size))
            self.counters.tree_heals += len(res.released) // self.page_size

    # ---- release -------------------------------------------------------------------------
    @_ledger_op
    async def finish(self, rid: int, tokens: np.ndarray) -> None:
        """Normal finish: committed whole pages go to the tree, the rest back to the pool;
        a session's turn instead moves its whole record to the session's slot."""
        self.require_at_rest(rid)
        self.counters.finished += 1
        session = self.turn_session.pop(rid, None)
        slot = self.slots.get(session) if session is not None else None
        if slot is None or slot.close_pending:
            await self._release(rid, tokens if self.tree is not None else None)
            if slot is not None:
                del self.slots[session]
            return
        self._held(rid)
        self._move_request_to_slot(rid, session, slot, self._keys(rid, tokens))
        self.counters.session_saves += 1
        await self._cap_sessions()

    @_ledger_op
    async def abort(self, rid: int) -> None:
        """Abort at any stage; idempotent. Nothing is inserted into the tree; a session's
        turn leaves the session's slot empty (its KV was the request's)."""
        rec = self.records.get(rid)
        if rec is not None and rec.is_held:
            await self._release(rid, None)
        self._end_turn(rid)
        self.counters.aborted += 1

    @_ledger_op
    async def retract(self, rid: int, tokens: np.ndarray) -> None:
        """KV pressure: cache the computed prefix in the tree, free the rest, keep the record.

        The request goes back to the waiting queue; re-admission matches its prefix again
        (a session's turn stays the session's; its slot stays empty).
        """
        self.require_at_rest(rid)
        await self._release(rid, tokens if self.tree is not None else None)
        self.counters.retracted += 1

    def _end_turn(self, rid: int) -> None:
        session = self.turn_session.pop(rid, None)
        slot = self.slots.get(session) if session is not None else None
        if slot is not None:
            slot.turn = None
            if slot.close_pending:
                del self.slots[session]

    async def _release(self, rid: int, tokens: np.ndarray | None) -> None:
        keys = self._keys(rid, tokens) if tokens is not None else None
        await self._free_record(self._held(rid), self.lock_nodes.pop(rid, None), keys)

    async def _free_record(self, rec: ReqKvInfo, node: int | None, tokens: np.ndarray | None):
        """Give back a held record's row and pages (with `tokens`, its committed whole pages
        to the tree) and unlock its tree node; the record ends released."""
        ps = self.page_size
        row = rec.req_pool_idx
        slots = self.table.read(row, 0, rec.kv_allocated_len)
        own_from = rec.cache_protected_len
        if tokens is not None:
            aligned = floor_page(rec.kv_committed_len, ps)
            if aligned > rec.cache_protected_len:
                res = await self.tree.insert(
                    tokens[:aligned],
                    slots[:aligned],
                    unlock_node=node,
                    lock_new=False,
                    alive=self._alive(slots[:aligned]),
                )
                node = None
                protected = rec.cache_protected_len
                self._take_tree_pages(None, slots[protected:aligned], res, protected, [])
                own_from = aligned
        if node is not None:
            await self.tree.unlock(node)
        tail = slots[own_from : rec.kv_allocated_len]
        if tail.size:
            self._free_pages(pages_of_slots(tail, ps))
        self.table.free_row(row)
        rec.req_pool_idx = None
        rec.mark_released()

    # ---- sessions ------------------------------------------------------------------------
    def open_slot(self, sid: str, priority: int = 0, retain_s: float = 0.0) -> None:
        """An empty slot for a new session, with the client's hints (an open slot is kept
        as it is)."""
        if sid not in self.slots:
            self.slots[sid] = SessionSlot()
            self.hint_slot(sid, priority, retain_s)

    def hint_slot(self, sid: str, priority: int, retain_s: float) -> None:
        """Set a session's hints (`SessionSlot`); its retention counts from now."""
        slot = self.slots[sid]
        slot.priority, slot.retain_s = priority, retain_s
        slot.retain_until = time.monotonic() + retain_s

    @_ledger_op
    async def close_slots(self, sessions: list[str]) -> int:
        """Release these sessions' slots (committed whole pages to the prefix tree, the rest
        to the pool, the row back); a slot whose turn is running is released when the turn
        ends. Unknown ids are ignored. Returns the pages the slots held."""
        pages = 0
        for sid in sessions:
            slot = self.slots.get(sid)
            if slot is None:
                continue
            if slot.turn is not None:
                slot.close_pending = True
                continue
            pages += await self._release_slot_kv(sid, slot, cache=True)
            if slot.stored is not None:
                await self._drop_entry(slot.stored)
            del self.slots[sid]
        return pages

    async def _release_slot_kv(self, sid: str, slot: SessionSlot, cache: bool) -> int:
        """Free what `slot` holds (the slot stays, empty); how many pages it held."""
        rec = slot.rec
        if rec is None:
            return 0
        pages = self._own_pages(rec)
        tokens = slot.tokens if cache and self.tree is not None else None
        await self._free_record(rec, self.session_lock_nodes.pop(sid, None), tokens)
        slot.rec = None
        slot.tokens = np.zeros(0, dtype=np.int64)
        return pages

    @_ledger_op
    async def offload_slot(self, sid: str) -> tuple[int, int]:
        """A client's hint: move this idle session's KV out of the pool now (demoted to the
        host tier when there is one; its pages freed, not cached). (pages freed, positions
        stored). An empty slot, or one whose turn runs, gives (0, 0); nothing changes."""
        slot = self.slots.get(sid)
        if slot is None or slot.rec is None or slot.turn is not None:
            return 0, 0
        await self._demote(sid, slot)
        await self._fit_host_tier()
        # Freed, not cached, only when a tier holds it: otherwise the tree keeps what it can.
        pages = await self._release_slot_kv(sid, slot, cache=slot.stored is None)
        stored = self._entry(slot.stored).length if slot.stored is not None else 0
        return pages, stored

    def spilled_entry(self, sid: str) -> TierEntry | None:
        """This session's tier entry when it is idle and its KV waits on the disk tier
        (what a turn arriving for it would read), else None. The entry becomes the most
        recently used (its turn is coming: the tier drops others first)."""
        slot = self.slots.get(sid)
        if slot is None or slot.turn is not None or slot.rec is not None or self.disk is None:
            return None
        entry = self.disk.entries.get(slot.stored) if slot.stored is not None else None
        if entry is not None and entry.handle in self.writing:
            return None  # its bytes are still in memory: the load reads no file
        if entry is not None:
            entry.last_used = next(self._clock)
        return entry

    @_ledger_op
    async def prefetch_slot(self, sid: str) -> int:
        """A client's hint: load this idle session's KV from its tier back into the pool
        now (its pages from the prefix tree where it still has them), so its next turn
        starts without the load. The slot then holds a record as after a turn. Positions in
        the pool after it; 0, changing nothing, when there is no tier entry, the pool or
        the rows have no room without taking another session's, or the load failed (the
        entry is then dropped and the next turn prefills)."""
        slot = self.slots.get(sid)
        if slot is None or slot.turn is not None:
            return 0
        if slot.rec is not None:
            return slot.rec.kv_committed_len
        # A spare row stays for the next admission, which would otherwise take an idle
        # session's.
        if slot.stored is None or self.table.num_free_rows < 2:
            return 0
        entry = self._entry(slot.stored)
        keys = entry.tokens.copy()
        cached, node, prefix_slots = 0, None, _NO_PAGES
        if self.tree is not None:
            cached, node, prefix_slots = await self._match_and_lock(keys)
        plan = plan_promotion(entry, len(keys), cached, self.window, self.page_size)
        need = self._pages_for(cached, len(keys), open_page=False)
        if self.session_max_pages is not None:
            # Past the sessions' cap the next finish would take another idle session's.
            # Its matched prefix will be locked by this slot, idle: pinned as well.
            if await self.pinned_pages(also_locked=node) + need > self.session_max_pages:
                plan = None
        deltas: list = []
        new_slots = None
        # A hint never takes another session's KV out of the pool: free and evictable
        # tree pages only.
        if plan is not None and not await self._shortfall(need, with_sessions=False):
            self._promoting = frozenset([slot.stored])
            try:
                new_slots = await self._reserve_slots(cached, len(keys), None, deltas)
            finally:
                self._promoting = frozenset()
        if new_slots is not None and not await self._load_entry(sid, cached, plan, new_slots):
            self._free_pages(pages_of_slots(new_slots, self.page_size))
            new_slots = None
        self._pending += deltas
        if new_slots is None:
            if node is not None:
                await self.tree.unlock(node)
            return 0
        rec = ReqKvInfo()
        row = self.table.alloc_row()
        rec.req_pool_idx = row
        rec.cache_protected_len = cached
        rec.kv_allocated_len = rec.kv_committed_len = len(keys)
        if plan.dead_to > plan.dead_from:
            rec.swa_evict_floor, rec.swa_evicted_seqlen = plan.dead_from, plan.dead_to
        elif self.swa is not None and not self.swa_free_prompt:
            rec.swa_evict_floor = len(keys)
        if cached:
            self.table.write(row, 0, prefix_slots)
            self._pending.append(SlotDelta(row, 0, prefix_slots))
            self.session_lock_nodes[sid] = node
        self.table.write(row, cached, new_slots)
        self._pending.append(SlotDelta(row, cached, new_slots))
        slot.rec, slot.tokens, slot.last_used = rec, keys, next(self._clock)
        return len(keys)

    @_ledger_op
    async def persist_sessions(self, sessions: list[str]) -> list[tuple[str, TierEntry]]:
        """On drain: move these idle sessions' KV to the disk tier (demoted, spilled; their
        pool pages freed) so a restart finds it. The sessions whose entry is on disk now,
        with it; a session running a turn, or whose KV cannot be written, is left out."""
        if self.host is None or self.disk is None:
            return []
        for sid in sessions:
            slot = self.slots.get(sid)
            if slot is None or slot.turn is not None:
                continue
            if slot.rec is not None:
                await self._demote(sid, slot)
                await self._release_slot_kv(sid, slot, cache=False)
            if slot.stored is not None and slot.stored in self.host.entries:
                if not await self._spill(slot.stored, wait=True):
                    await self._drop_entry(slot.stored)
        for handle in list(self.writing):  # the disk tier's budget counts files only
            await self._wait_written(handle)
        await self._fit_host_tier()  # the disk tier's budget
        out = []
        for sid in sessions:
            slot = self.slots.get(sid)
            if slot is not None and slot.turn is None and slot.stored in self.disk.entries:
                out.append((sid, self.disk.entries[slot.stored]))
        return out

    @_ledger_op
    def restore_sessions(self, persisted: list[tuple[str, TierEntry]]) -> list[int]:
        """At start: a previous run's persisted sessions, each a slot naming its disk-tier
        entry (its next turn promotes it as any). Entries that do not fit the disk budget,
        or name a session or handle in use, are not taken: their handles are returned (the
        caller has the store delete them)."""
        refused = []
        for sid, entry in persisted:
            taken = any(entry.handle in t.entries for t in self._tiers())
            if (
                self.disk is None
                or taken
                or sid in self.slots
                or self.disk.used + entry.nbytes > self.disk.budget
            ):
                refused.append(entry.handle)
                continue
            entry.last_used = next(self._clock)
            self.disk.add(entry)
            self.entry_session[entry.handle] = sid
            self.slots[sid] = SessionSlot(stored=entry.handle, last_used=entry.last_used)
        in_use = [h for t in self._tiers() for h in t.entries]
        handles = in_use + [entry.handle for _, entry in persisted]
        self._handles = itertools.count(max(handles, default=0) + 1)
        return refused

    def slot_tokens(self, sid: str) -> int:
        """Tokens whose KV session `sid` holds now, in the pool or the host tier (0: none,
        or no such slot)."""
        slot = self.slots.get(sid)
        if slot is None:
            return 0
        if slot.stored is not None:
            return self._entry(slot.stored).length
        return slot.rec.kv_committed_len if slot.rec is not None else 0

    def session_pages(self) -> int:
        """Pages pinned by session slots (their own pages, not the tree prefix they lock)."""
        return sum(self._own_pages(s.rec) for s in self.slots.values() if s.rec is not None)

    async def _pages_idle_slots_lock(
        self, idle: list[tuple[str, SessionSlot]], also_locked: int | None = None
    ) -> np.ndarray:
        """The tree pages whose every lock is an idle slot's in `idle` (or `also_locked`, a
        lock that will be an idle slot's): evictable once those slots are released."""
        nodes = [self.session_lock_nodes[sid] for sid, _ in idle if sid in self.session_lock_nodes]
        if also_locked is not None:
            nodes.append(also_locked)
        if self.tree is None or not nodes:
            return _NO_PAGES
        return await self.tree.pages_freed_by_unlocking(nodes)

    async def reclaimable_pages(self) -> int:
        """Pages an admission may take from idle sessions (their slots released under
        pressure): their own pages, and the tree pages only they lock."""
        idle = self._idle_slots()
        own = sum(self._own_pages(slot.rec) for _, slot in idle)
        return own + len(await self._pages_idle_slots_lock(idle))

    async def pinned_pages(self, also_locked: int | None = None) -> int:
        """Pages idle sessions keep from everybody else: every slot's own pages and the
        tree pages only idle slots lock (what `sessions.max_pinned_share` caps)."""
        unlocked = await self._pages_idle_slots_lock(self._idle_slots(), also_locked)
        return self.session_pages() + len(unlocked)

    def _idle_slots(self) -> list[tuple[str, SessionSlot]]:
        """Slots holding KV between turns, lowest priority and then least recently used first
        (the one being restored now excluded)."""
        idle = [
            (sid, s)
            for sid, s in self.slots.items()
            if s.rec is not None and s.turn is None and sid != self._restoring
        ]
        return sorted(idle, key=lambda item: (item[1].priority, item[1].last_used))

    async def _reclaim_idle_slot(self) -> bool:
        """`_reclaim_session`, True only when it emptied an idle slot (its own pages freed
        or cached, its tree lock released): a loop of these ends, even on a slot whose
        release failed to take anything."""
        before = len(self._idle_slots())
        return await self._reclaim_session() and len(self._idle_slots()) < before

    async def _reclaim_session(self) -> bool:
        """Release the lowest-priority, least recently used idle slot (the session stays
        open): demoted to the host tier when there is one (its pages freed), else to the
        prefix tree (its committed whole pages become cached, evictable KV); its next turn
        loads or prefills what it lost. False: no idle slot."""
        idle = self._idle_slots()
        if not idle:
            return False
        sid, slot = idle[0]
        await self._demote(sid, slot)
        # Demoted: its entry holds the KV, so its pages are freed, not cached twice.
        await self._release_slot_kv(sid, slot, cache=slot.stored is None)
        self.counters.session_reclaims += 1
        await self._fit_host_tier()
        return True

    # ---- the host tier (module docstring) ------------------------------------------------
    async def _demote(self, sid: str, slot: SessionSlot) -> None:
        """Copy the idle slot's history (positions [0, committed): the full layers' KV, and
        the sliding layers' for the last window) to the host tier under a new handle the slot
        owns.
        The caller then releases the slot's pool KV. A failed copy keeps nothing."""
        rec = slot.rec
        n = rec.kv_committed_len
        if self.host is None or n == 0:
            return
        ps = self.page_size
        slots = self.table.read(rec.req_pool_idx, 0, n)
        alive = self._alive(slots)
        swa_slots = _NO_PAGES
        if alive is not None:
            # Sliding KV only for the window the next turn's queries read: a turn that
            # continues the conversation needs no more, one that diverges earlier prefills.
            alive = alive.copy()
            alive[: floor_page(max(n - self.window, 0), ps) // ps] = False
            swa_slots = self._sliding_slots(slots[np.flatnonzero(np.repeat(alive, ps)[:n])])
        handle = next(self._handles)
        try:
            nbytes = await self.tiers.save(handle, slots, swa_slots)
        except Exception:  # the runner could not copy: the KV goes to the tree alone
            self.counters.tier_failures += 1
            return
        entry = TierEntry(handle, slot.tokens.copy(), alive, nbytes, next(self._clock))
        self.host.add(entry)
        self.entry_session[handle] = sid
        slot.stored = handle
        self.counters.session_demotes += 1

    async def _plan_promotion(
        self, session: str, tokens: np.ndarray, cached: int, match_prefix: bool
    ) -> Promotion | None:
        """What this admission loads from its session's tier entry (None: nothing; the
        admission drops the entry once granted, so a refused one finds it again)."""
        slot = self.slots.get(session)
        if slot is None or slot.stored is None:
            return None
        entry = self._entry(slot.stored)
        if not match_prefix or len(tokens) < 2:
            return None
        prefix = common_prefix_len(entry.tokens, tokens[: len(tokens) - 1])
        return plan_promotion(entry, prefix, cached, self.window, self.page_size)

    async def _load_entry(
        self, session: str, cached: int, plan: Promotion, new_slots: np.ndarray
    ) -> bool:
        """Write the entry's positions [cached, plan.length) at the first of `new_slots`
        (reserved from `cached`); the entry is dropped whatever happens. False: the load
        failed (nothing valid was written; the caller computes those positions)."""
        ps = self.page_size
        handle = self.slots[session].stored
        entry = self._entry(handle)
        from_disk = self.disk is not None and handle in self.disk.entries
        from_disk = from_disk and handle not in self.writing
        swa_index = swa_slots = _NO_PAGES
        if entry.alive is not None:
            saved = entry.saved_swa_positions(ps)
            lo, hi = np.searchsorted(saved, [cached, plan.length])
            swa_index = np.arange(lo, hi, dtype=np.int64)
            swa_slots = self._sliding_slots(new_slots[saved[lo:hi] - cached])
        full = new_slots[: plan.length - cached]
        try:
            await self.tiers.load(handle, cached, full, swa_index, swa_slots)
            loaded = True
        except Exception:  # the runner could not copy: prefill instead
            self.counters.tier_failures += 1
            loaded = False
        await self._drop_entry(handle)
        if not loaded:
            return False
        if plan.dead_to > plan.dead_from:
            # Pages whose sliding KV the history had lost stay without it in the pool too.
            self._unmap(new_slots[plan.dead_from - cached : plan.dead_to - cached : ps] // ps)
        self.counters.session_promotes += 1
        self.counters.disk_promotes += from_disk
        self.counters.promoted_tokens += plan.length - cached
        return True

    async def _drop_entry(self, handle: int, tell_store: bool = True) -> None:
        """Forget a tier entry (its owner, a session's slot or the prefix index, names
        nothing after it) and have the store free its bytes (a message the store answers
        nothing to)."""
        self._tier_with(handle).remove(handle)
        self.writing.pop(handle, None)
        if self.prefix_blocks is not None and handle in self.prefix_blocks:
            self.prefix_blocks.remove(handle)
        else:
            slot = self.slots.get(self.entry_session.pop(handle))
            if slot is not None and slot.stored == handle:
                slot.stored = None
        if not tell_store:
            return
        try:
            await self.tiers.drop([handle])
        except Exception:  # a lost store holds nothing; the idle audit repairs the rest
            self.counters.tier_failures += 1

    async def _fit_host_tier(self) -> None:
        """Move host-tier entries, least recently used first, to the disk tier (or drop them
        without one, or when the write fails) until the host tier fits its budget; then fit
        the disk tier, dropping its least recently used. The entry an admission is loading
        now never moves."""
        if self.host is None:
            return
        # Sorting every entry is the cost here: only when a budget is exceeded (this runs
        # once per evicted block on an admission's path).
        for handle in self._victims(self.host) if self.host.over_budget() else ():
            if not self.host.over_budget():
                break
            # A prefix block nobody loaded is not worth a file: dropped.
            unused_block = self.prefix_blocks is not None and handle in self.prefix_blocks
            unused_block = unused_block and not self.host.entries[handle].loads
            if self.disk is None or unused_block or not await self._spill(handle):
                await self._drop_entry(handle)
                self.counters.tier_drops += 1
        disk_over = self.disk is not None and self.disk.over_budget()
        for handle in self._victims(self.disk) if disk_over else ():
            if not self.disk.over_budget():
                break
            await self._drop_entry(handle)
            self.counters.tier_drops += 1

    def _victims(self, tier: KvTier) -> list[int]:
        """The tier's entries in the order they leave it: a retained session's last, then
        by priority (a prefix block: 0 once loaded, below every session until then), least
        recently used first; never one being loaded."""
        now = time.monotonic()

        def rank(handle: int) -> tuple:
            slot = self.slots.get(self.entry_session.get(handle, ""))
            entry = tier.entries[handle]
            if slot is None:
                return (False, 0 if entry.loads else -(1 << 20), entry.last_used)
            return (slot.retain_until > now, slot.priority, entry.last_used)

        return sorted((h for h in tier.entries if h not in self._promoting), key=rank)

    async def _spill(self, handle: int, wait: bool = False) -> bool:
        """Host -> disk: the runner writes the entry's bytes to a file (checksummed) and
        frees its host copy. With `spill_later` and room among the writes in flight (and
        not `wait`), the entry is on the disk tier at once and its file follows
        (`spill_done`). False: the write failed (the entry is still in the host)."""
        if self.spill_later is not None and not wait:
            host_bytes = self.host.entries[handle].nbytes
            bound = min(self.host.budget, MAX_WRITING_BYTES)
            if not self.writing or sum(self.writing.values()) + host_bytes <= bound:
                self.disk.add(self.host.remove(handle))
                self.writing[handle] = host_bytes
                self.spill_later(handle)
                return True
        try:
            nbytes = await self.tiers.spill(handle)
        except Exception:  # disk full, unwritable: the caller drops the entry instead
            self.counters.tier_failures += 1
            return False
        entry = self.host.remove(handle)
        entry.nbytes = nbytes
        self.disk.add(entry)
        self.counters.tier_spills += 1
        return True

    @_ledger_op
    async def spill_done(self, handle: int, nbytes: int | None) -> None:
        """The runner's write of a writing entry ended: the file holds `nbytes` (the disk
        tier then fits its budget again), or it failed (None: the entry is dropped, its
        session prefills). An entry no longer writing (dropped, loaded, waited for) is left
        as it is."""
        if self.writing.pop(handle, None) is None or handle not in self.disk.entries:
            return
        if nbytes is None:
            self.counters.tier_failures += 1
            await self._drop_entry(handle)
            return
        entry = self.disk.entries[handle]
        self.disk.used += nbytes - entry.nbytes
        entry.nbytes = nbytes
        self.counters.tier_spills += 1
        await self._fit_host_tier()

    async def _wait_written(self, handle: int) -> bool:
        """A writing entry's file, waited for (the drain's manifest names only files);
        False: the write failed and the entry was dropped."""
        if handle not in self.writing:
            return True
        try:
            nbytes = await self.tiers.spill(handle)  # the store joins the write under way
        except Exception:
            nbytes = None
        await self.spill_done(handle, nbytes)
        return nbytes is not None

    # ---- prefix-tree blocks below the pool (module docstring) ---------------------------
    async def _evict_tree(self, pages: int) -> np.ndarray:
        """Evict at least `pages` tree pages (LRU leaves); with a prefix index, each evicted
        block is copied to the host tier first. The freed pages, for the caller to free."""
        if self.prefix_blocks is None:
            return await self.tree.evict(pages)
        blocks = await self.tree.evict_blocks(pages)
        slots = [b.slots for b in blocks]
        freed = pages_of_slots(np.concatenate(slots), self.page_size) if slots else _NO_PAGES
        # One eviction copies at most half the host tier (a huge admission does not stall
        # on gigabytes it would drop again), fitting the budget block by block.
        allowance = self.host.budget // 2
        try:
            for block in blocks:
                if allowance <= 0:
                    break
                before = self.host.used
                await self._demote_block(block)
                allowance -= max(self.host.used - before, 0)
                await self._fit_host_tier()
        except BaseException:
            self._free_pages(freed)  # unlinked from the tree: never leaked
            self.counters.evicted_pages += int(freed.size)
            raise
        return freed

    async def _demote_block(self, block: EvictedBlock) -> None:
        """Keep an evicted block's leading pages that have their sliding KV (all of them
        with one pool) as a prefix block, unless one already holds them. A failed copy
        keeps nothing (the block is forgotten, as without a tier)."""
        ps = self.page_size
        alive = np.asarray(block.alive, dtype=bool)
        n = (int(np.argmin(alive)) if not alive.all() else len(alive)) * ps
        if n == 0:
            return
        end = block.start + n
        tokens = np.asarray(block.key[:end], dtype=np.int64)
        known = self.prefix_blocks.get(tokens, block.start)
        if known is not None:
            entry = self._entry(known)
            same = entry.length >= end and np.array_equal(entry.tokens[:end], tokens)
            if same or known in self._promoting:
                entry.last_used = next(self._clock)
                self.counters.block_demote_skips += 1
                return
        slots = np.asarray(block.slots[:n], dtype=np.int64)
        swa_slots = self._sliding_slots(slots) if self.swa is not None else _NO_PAGES
        handle = next(self._handles)
        try:
            nbytes = await self.tiers.save(handle, slots, swa_slots)
        except Exception:  # the runner could not copy: the block is forgotten
            self.counters.tier_failures += 1
            return
        if known is not None:
            await self._drop_entry(known)  # a shorter or colliding block: this one replaces it
        alive_pages = None
        if self.swa is not None:
            alive_pages = np.arange(end // ps) >= block.start // ps  # the pages it saved
        entry = TierEntry(handle, tokens, alive_pages, nbytes, next(self._clock), block.start)
        self.host.add(entry)
        self.prefix_blocks.add(entry)
        self.counters.block_demotes += 1

    async def _load_blocks(self, loads: list[BlockLoad], cached: int, new_slots) -> int:
        """Write each block's planned positions at the request's slots reserved from
        `cached`; the position loaded up to (a failed load stops there, and its block is
        dropped). A loaded block stays stored (a popular prefix serves the next eviction)."""
        for load in loads:
            entry = self._entry(load.handle)
            full = new_slots[load.start - cached : load.end - cached]
            saved = np.arange(load.start - entry.start, load.end - entry.start, dtype=np.int64)
            swa_index = saved if self.swa is not None else _NO_PAGES
            swa_slots = self._sliding_slots(full) if self.swa is not None else _NO_PAGES
            try:
                await self.tiers.load(load.handle, int(saved[0]), full, swa_index, swa_slots)
            except Exception:  # a missing or corrupt copy: compute from here
                self.counters.tier_failures += 1
                await self._drop_entry(load.handle)
                return load.start
            entry.last_used = next(self._clock)
            entry.loads += 1
            self.counters.block_loaded_tokens += load.end - load.start
        self.counters.block_promotes += 1
        return loads[-1].end

    def _tiers(self) -> list[KvTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    def _tier_with(self, handle: int) -> KvTier:
        return next(t for t in self._tiers() if handle in t.entries)

    def _entry(self, handle: int) -> TierEntry:
        return self._tier_with(handle).entries[handle]

    def _entry_or_none(self, handle: int) -> TierEntry | None:
        for tier in self._tiers():
            entry = tier.entries.get(handle)
            if entry is not None:
                return entry
        return None

    def _sliding_slots(self, full_slots: np.ndarray) -> np.ndarray:
        """The sliding pool's slots of these full slots (their pages are mapped)."""
        ps = self.page_size
        full_slots = np.asarray(full_slots, dtype=np.int64)
        return self.swa.map[full_slots // ps] * ps + full_slots % ps

    def session_entries(self, tier: str) -> int:
        """Sessions whose entry is in this tier ("host" or "disk")."""
        held = {"host": self.host, "disk": self.disk}[tier]
        return 0 if held is None else sum(1 for h in self.entry_session if h in held.entries)

    def stored_tokens(self) -> int:
        """Positions whose KV the tiers hold."""
        return sum(e.length - e.start for t in self._tiers() for e in t.entries.values())

    async def _cap_sessions(self) -> None:
        """Release idle slots, least recently used first, until they pin at most
        `session_max_pages` pages (`pinned_pages`: their tree prefixes too)."""
        if self.session_max_pages is None:
            return
        while await self.pinned_pages() > self.session_max_pages:
            if not await self._reclaim_idle_slot():
                return

    def check_held(self, rids: list[int], need_held: list[bool] | None = None) -> None:
        """Raise `LedgerError` before a batch is applied if any item would fail: every rid
        once, and holding KV where `need_held` says so (default: all)."""
        _require_unique(rids)
        for i, rid in enumerate(rids):
            if need_held is None or need_held[i]:
                self._held(rid)

    # ---- audit ---------------------------------------------------------------------------
    async def snapshot(self) -> KvSnapshot:
        return KvSnapshot(
            page_size=self.page_size,
            total_pages=self.pool.num_pages,
            free_pages=self.pool.free_pages(),
            tree=await self.tree.snapshot() if self.tree is not None else None,
            table=self.table.table,
            held_rows=self.table.held_rows(),
            records=self.records,
            lock_nodes=self.lock_nodes,
            session_records={sid: s.rec for sid, s in self.slots.items() if s.rec is not None},
            session_lock_nodes=self.session_lock_nodes,
            swa_map=self.swa.map if self.swa is not None else None,
            swa_free_pages=self.swa.pool.free_pages() if self.swa is not None else None,
            swa_total_pages=self.swa.num_pages if self.swa is not None else 0,
            swa_window=self.window if self.swa is not None else 0,
            tiers=self._tiers(),
            session_entries={
                sid: s.stored for sid, s in self.slots.items() if s.stored is not None
            },
            prefix_blocks=self.prefix_blocks,
        )

    async def check(self) -> None:
        check_invariants(await self.snapshot())

    async def idle_problems(self, audit_store: bool = False) -> list[str]:
        """The cheap conservation check of an idle engine (no request holds anything; only
        session slots may, in the pool or the host tier): what is wrong, naming the owners,
        or []. `audit_store`: the runner's store must hold exactly the tier's entries."""
        evictable = protected = 0
        if self.tree is not None:
            evictable, protected = await self.tree.sizes()
        held = [s.rec for s in self.slots.values() if s.rec is not None]
        problems = check_idle(
            free=self.pool.num_free,
            tree_pages=(evictable + protected) // self.page_size,
            total=self.pool.num_pages,
            records=len(self.records),
            held_rows=len(self.table.held_rows()),
            locked_tokens=protected,
            session_pages=self.session_pages(),
            session_rows=len(held),
            session_locked_tokens=sum(r.cache_protected_len for r in held),
            turns=len(self.turn_session),
            request_locks=len(self.lock_nodes),
            orphan_session_locks=sum(
                1
                for sid in self.session_lock_nodes
                if sid not in self.slots or self.slots[sid].rec is None
            ),
        )
        if self.swa is not None:
            problems += swa_idle_problems(self.swa, self.pool.free_pages())
        if self.host is not None:
            problems += await self._tier_problems(audit_store)
        if problems and self.records:
            owners = {
                rid: (rec.req_pool_idx, rec.kv_allocated_len)
                for rid, rec in list(self.records.items())[:8]
            }
            problems.append(f"records (rid: row, allocated): {owners}")
        return problems

    async def _tier_problems(self, audit_store: bool) -> list[str]:
        """The tiers' check; with `audit_store`, the runner's store against the ledger, which
        is the truth: bytes the store holds under handles the ledger forgot (a save that
        outlived its timeout, a lost drop) are freed, and an entry whose bytes the store lost
        is dropped (its session prefills). Either is reported."""
        store = None
        problems: list[str] = []
        if audit_store:
            try:
                store = await self.tiers.contents()
            except Exception as exc:  # reported, not raised: the check names what is wrong
                return [f"the runner's KV store did not answer the audit: {exc}"]
            known = {h for t in self._tiers() for h in t.entries}
            stray = sorted(set(store) - known)
            lost = sorted(known - set(store))
            if stray:
                problems.append(f"the runner's store held forgotten entries {stray[:8]}; freed")
                await self.tiers.drop(stray)
            for handle in lost:
                await self._drop_entry(handle, tell_store=False)
            if lost:
                problems.append(f"the runner's store lost entries {lost[:8]}; dropped")
            store = {h: v for h, v in store.items() if h in known and h not in lost}
            for handle, host_bytes in self.writing.items():
                # Its file is being written: the store holds the host copy until then, and
                # may report the file's size before `spill_done` comes.
                tier, nbytes = store.get(handle, ("", 0))
                entry = self.disk.entries.get(handle) if self.disk is not None else None
                if entry is not None and (tier == "disk" or (tier, nbytes) == ("host", host_bytes)):
                    store[handle] = ("disk", entry.nbytes)
        not_on_disk = sorted(set(self.writing) - set(self.disk.entries if self.disk else ()))
        if not_on_disk:
            problems.append(f"files {not_on_disk[:8]} are being written for no disk-tier entry")
        entries = {sid: s.stored for sid, s in self.slots.items() if s.stored is not None}
        with_records = {sid for sid, s in self.slots.items() if s.rec is not None}
        try:
            check_tiers(self._tiers(), entries, with_records, store, self.prefix_blocks)
        except TierViolation as exc:
            problems.append(str(exc))
        return problems

    @_ledger_op
    async def drop_cache(self) -> int:
        """Forget every cached KV (its contents are gone, e.g. the runner restarted): evict
        the whole prefix tree and empty every session slot (the sessions stay open); how many
        pages. Only with no request record left: a live request may read those pages, so
        then `LedgerError` and nothing changes."""
        if self.records:
            raise LedgerError(f"{len(self.records)} requests still hold KV; end them first")
        dropped = 0
        for sid, slot in self.slots.items():
            dropped += await self._release_slot_kv(sid, slot, cache=False)
        for handle in [h for t in self._tiers() for h in t.entries]:
            # The store went with the runner: forget the entry, ask nobody.
            await self._drop_entry(handle, tell_store=False)
        if self.tree is None:
            return dropped
        freed = await self.tree.evict(self.pool.num_pages)
        self._free_pages(freed)
        self.counters.evicted_pages += int(freed.size)
        return dropped + int(freed.size)

    def held_pages(self) -> int:
        """Pages owned by live requests (not the tree's shared prefix pages, nor sessions')."""
        return sum(self._own_pages(r) for r in self.records.values() if r.is_held)

    def _own_pages(self, rec: ReqKvInfo) -> int:
        ps = self.page_size
        return ceil_page(rec.kv_allocated_len, ps) // ps - rec.cache_protected_len // ps

    # ---- internals -----------------------------------------------------------------------
    def _held(self, rid: int) -> ReqKvInfo:
        rec = self.records.get(rid)
        if rec is None or not rec.is_held:
            raise LedgerError(f"request {rid} holds no KV")
        return rec

    def _last_slot(self, rec: ReqKvInfo) -> int | None:
        if rec.kv_allocated_len == 0:
            return None
        return int(self.table.table[rec.req_pool_idx, rec.kv_allocated_len - 1])

    async def _ensure_free(self, pages: int) -> int:
        """Make `pages` free in the full pool (and the sliding pool), evicting from the tree
        and then releasing idle session slots to it if that suffices: 0, or the pages still
        missing counting every evictable and reclaimable one (then nothing changed)."""
        short = await self._shortfall(pages)
        if short:
            return short
        while True:
            missing = max(pages - self.pool.num_free, 0)
            if self.swa is not None:
                missing = max(missing, pages - self.swa.num_free)
            if missing == 0:
                return 0
            # Evicted pages whose sliding KV was already freed give no sliding page: evict on
            # until both pools have enough (`_shortfall` counted that they will).
            freed = await self._evict_tree(missing) if self.tree is not None else _NO_PAGES
            if freed.size:
                self._free_pages(freed)
                self.counters.evicted_pages += int(freed.size)
            elif not await self._reclaim_idle_slot():
                raise LedgerError(f"eviction found nothing; {missing} pages missing")

    async def _shortfall(self, pages: int, returning: int = 0, with_sessions=True) -> int:
        """Pages missing for an allocation of `pages` once `returning` more are freed, every
        idle session slot is released (unless not `with_sessions`) and every evictable tree
        page is evicted (0: it can be done); changes nothing."""
        short = pages - returning - self.pool.num_free
        swa_short = pages - returning - self.swa.num_free if self.swa is not None else 0
        if short <= 0 and swa_short <= 0:
            return 0
        # An idle slot's own pages all end free or evictable once it is released, and so
        # do the tree pages that only idle slots lock (a prefix a slot matched, or the
        # chunks its prefill cached: often most of a session's KV).
        idle = self._idle_slots() if with_sessions else []
        for _, slot in idle:
            short -= self._own_pages(slot.rec)
            if self.swa is not None:
                swa_short -= int(self.swa.mapped(self._own_page_ids(slot.rec)).sum())
        if (short > 0 or swa_short > 0) and idle:
            unlocked = await self._pages_idle_slots_lock(idle)
            short -= len(unlocked)
            if self.swa is not None:
                swa_short -= int(self.swa.mapped(unlocked).sum())
        if short <= 0 and swa_short <= 0:
            return 0
        if self.tree is None:
            return max(short, swa_short)
        evictable = await self.tree.evictable_pages()
        if short > evictable:
            return short - evictable
        if swa_short > 0:
            # Only evictable pages that still have a sliding page give one back.
            snap = await self.tree.snapshot()
            pages_held = [
                np.asarray(v, dtype=np.int64)[:: self.page_size] // self.page_size
                for v, locks in zip(snap.values, snap.lock_refs)
                if locks == 0 and len(v)
            ]
            with_swa = int(self.swa.mapped(np.concatenate(pages_held)).sum()) if pages_held else 0
            if swa_short > with_swa:
                return swa_short - with_swa
        return 0

    def _own_page_ids(self, rec: ReqKvInfo) -> np.ndarray:
        """The physical pages of `rec`'s own part of its row."""
        ps = self.page_size
        row = self.table.table[rec.req_pool_idx, rec.cache_protected_len : rec.kv_allocated_len]
        return np.asarray(row[::ps], dtype=np.int64) // ps

    def _alloc_pages(self, n: int, deltas: list) -> np.ndarray:
        """`n` full pages, each with a sliding page when the pools are split (the caller made
        sure both pools have them); the new mappings go in `deltas` for the runner."""
        pages = self.pool.alloc(n)
        assert pages is not None, "caller must ensure free pages"
        if self.swa is not None and n:
            swa = self.swa.map_new(pages)
            assert swa is not None, "caller must ensure free sliding pages"
            self._send_unmapped(deltas)  # a page unmapped earlier may be mapped again here
            deltas.append(SwaMapDelta(pages, swa))
        return pages

    def _free_pages(self, pages: np.ndarray) -> None:
        """Give full pages back, with the sliding pages they still have."""
        self._unmap(pages)
        self.pool.free(pages)

    def _unmap(self, full_pages: np.ndarray) -> int:
        """Free the sliding pages of these full pages (those that have one); the runner
        learns it with the next deltas (`_send_unmapped`). How many were freed."""
        if self.swa is None:
            return 0
        full_pages = np.asarray(full_pages, dtype=np.int64)
        had = full_pages[self.swa.mapped(full_pages)]
        if had.size:
            self.swa.unmap(had)
            self._unmapped.append(had)
        return int(had.size)

    def _send_pending(self, deltas: list) -> list:
        """Deltas made by operations that reply with none go to the runner at the front of
        the next operation's, in order; the ones moved."""
        pending, self._pending = self._pending, []
        deltas[:0] = pending
        return pending

    def _send_unmapped(self, deltas: list) -> None:
        """Pending unmappings go to the runner as mappings to the padding page 0, before
        whatever mapping follows them in `deltas`."""
        if self._unmapped:
            pages = np.concatenate(self._unmapped)
            self._unmapped.clear()
            deltas.append(SwaMapDelta(pages, np.zeros_like(pages)))

    def _alive(self, slots: np.ndarray) -> np.ndarray | None:
        """Per page of these (page-aligned) row slots: its sliding KV exists (None: no
        sliding pool, every page's does)."""
        if self.swa is None:
            return None
        ps = self.page_size
        return self.swa.mapped(np.asarray(slots[::ps], dtype=np.int64) // ps)

    def _free_window(self, rec: ReqKvInfo, first_query: int) -> None:
        """Free the sliding pages of `rec` that no query from `first_query` on can read:
        positions <= first_query - window, whole pages, in steps, never below the tree's
        protected prefix or `swa_evict_floor`. Full layers keep everything."""
        if self.swa is None or not self.window:
            return
        ps = self.page_size
        hi = floor_page(first_query - self.window + 1, ps)
        lo = max(
            rec.swa_evicted_seqlen, rec.cache_protected_len, ceil_page(rec.swa_evict_floor, ps)
        )
        if hi - lo < self.swa_free_step:
            return
        pages = pages_of_slots(self.table.read(rec.req_pool_idx, lo, hi), ps)
        self.counters.swa_freed_pages += self._unmap(pages)
        rec.swa_evicted_seqlen = hi

    def _window_alive(self, rec: ReqKvInfo, end: int) -> bool:
        """The window a query at `end` reads, [end - window + 1, end), has sliding KV on
        every page of `rec`'s row (always, without a sliding pool)."""
        if self.swa is None or not self.window or end == 0:
            return True
        row = self.table.table[rec.req_pool_idx, max(end - self.window + 1, 0) : end]
        return bool(self.swa.mapped(pages_of_slots(row, self.page_size)).all())

    def _swa_usable(self, slots: np.ndarray, length: int) -> int:
        """The longest page-aligned prefix of a cached prefix (`slots`, `length` tokens)
        whose last window still has its sliding KV: a query right after it must find it."""
        if self.swa is None or not self.window or length == 0:
            return length
        ps = self.page_size
        mapped = self.swa.mapped(np.asarray(slots[:length:ps], dtype=np.int64) // ps)
        if mapped.all():
            return length
        for end_page in range(len(mapped), 0, -1):
            end = end_page * ps
            first = max(0, end - self.window + 1) // ps  # first page the next query reads
            if mapped[first:end_page].all():
                return end
        return 0

    def _pages_for(self, start: int, end: int, open_page: bool) -> int:
        """New pages that positions [start, end) need; with `open_page`, the page holding
        position start - 1 is the row's and takes the first positions."""
        ps = self.page_size
        n = end - start
        in_open_page = min(n, ps - start % ps) if start % ps and open_page else 0
        return ceil_page(n - in_open_page, ps) // ps

    async def _reserve_slots(
        self, start: int, end: int, last_slot: int | None, deltas: list
    ) -> np.ndarray | None:
        """Slots for positions [start, end): fill the open page after `last_slot`, then new
        pages."""
        ps = self.page_size
        n = end - start
        in_open_page = 0
        if start % ps and last_slot is not None:
            in_open_page = min(n, ps - start % ps)
        need_pages = self._pages_for(start, end, open_page=last_slot is not None)
        if await self._ensure_free(need_pages):
            return None
        pages = self._alloc_pages(need_pages, deltas)
        rest = slots_of_pages(pages, ps)[: n - in_open_page]
        if not in_open_page:
            return rest
        head = np.arange(last_slot + 1, last_slot + 1 + in_open_page, dtype=np.int64)
        return np.concatenate([head, rest])


_NO_PAGES = np.zeros(0, dtype=np.int64)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(differ[0]) if differ.size else n


def _require_unique(rids: list[int]) -> None:
    seen: set[int] = set()
    twice = sorted({rid for rid in rids if rid in seen or seen.add(rid)})
    if twice:
        raise LedgerError(f"requests {twice[:8]} appear twice in one message")
