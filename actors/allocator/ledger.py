"""The allocator's core: the only code that writes `ReqKvInfo` fields.

`KvLedger` owns every request's record, the page pool and the req-to-token
rows. It reaches the prefix tree only through a `PrefixPort`. All methods run
inside the allocator actor's mailbox, one at a time; each leaves the state
consistent (the invariant checker may run after any of them).

Row ranges a request owns, for a held record `r` with row R:
    R[0 : r.cache_protected_len)                    tree pages, locked by this request
    R[r.cache_protected_len : r.kv_allocated_len)   the request's own pages (whole pages)
Allocation commits: the call that reserves slots for an extend or a decode
step also advances kv_committed_len (no speculative decoding yet).

Slot deltas: every change to a row is returned as (row, start, slots) so the
model runner can mirror the table on its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from actors.allocator.prefix_port import PrefixPort
from kvcore import (
    KvSnapshot,
    PagePool,
    ReqKvInfo,
    ReqToTokenTable,
    ceil_page,
    check_idle,
    check_invariants,
    floor_page,
    pages_of_slots,
    slots_of_pages,
)


class LedgerError(Exception):
    """A request the ledger cannot honour (unknown rid, context overflow, misuse)."""


@dataclass(frozen=True, slots=True)
class SlotDelta:
    row: int
    start: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class ExtendGrant:
    rid: int
    row: int
    cached_len: int  # tokens matched from the prefix tree at admission (0 on later chunks)
    start: int  # first position computed by this extend (== previous committed length)
    end: int  # new committed length


@dataclass(slots=True)
class LedgerCounters:
    evicted_pages: int = 0
    cache_hit_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    retracted: int = 0


@dataclass
class KvLedger:
    pool: PagePool
    table: ReqToTokenTable
    tree: PrefixPort | None  # None: prefix caching disabled
    records: dict[int, ReqKvInfo] = field(default_factory=dict)
    lock_nodes: dict[int, int] = field(default_factory=dict)  # rid -> locked tree node
    counters: LedgerCounters = field(default_factory=LedgerCounters)

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

    # ---- extend (admission and prefill chunks) -------------------------------------------
    async def alloc_extend(
        self,
        rid: int,
        tokens: np.ndarray,
        budget: int,
        deltas: list[SlotDelta],
        match_prefix: bool = True,
    ) -> ExtendGrant | None:
        """Reserve and commit KV for the next prefill chunk of `rid` (at most `budget` tokens).

        `tokens` are all tokens known for the request (prompt, plus output after a
        retraction). A request not holding a row is admitted: prefix match (leaving at
        least one token to compute), row, slots. Returns None, changing nothing, when pages
        or rows run out even after eviction. `match_prefix=False` skips the prefix tree at
        admission (every token is computed; prompt logprobs need their logits).
        """
        self.check_extend(rid, len(tokens), budget)
        total = len(tokens)
        rec = self.records.get(rid)
        admitting = rec is None or not rec.is_held
        cached, node, prefix_slots = 0, None, None
        if admitting:
            if self.table.num_free_rows == 0:
                return None
            if self.tree is not None and total > 1 and match_prefix:
                match = await self.tree.match_and_lock(tokens[: total - 1])
                if match.length:
                    cached, node, prefix_slots = match.length, match.node_id, match.slots
            start = cached
        else:
            start = rec.kv_committed_len
        end = min(total, start + budget)
        row_tail = None if admitting else self._last_slot(rec)
        new_slots = await self._reserve_slots(start, end, row_tail)
        if new_slots is None:
            if node is not None:
                await self.tree.unlock(node)
            return None
        if admitting:
            # The record exists only once the request holds something (a refusal leaves none).
            if rec is None:
                rec = self.records[rid] = ReqKvInfo()
            row = self.table.alloc_row()
            assert row is not None  # checked above; only this mailbox allocates rows
            rec.req_pool_idx = row
            rec.cache_protected_len = cached
            if cached:
                self.table.write(row, 0, prefix_slots)
                deltas.append(SlotDelta(row, 0, prefix_slots))
                self.lock_nodes[rid] = node
                self.counters.cache_hit_tokens += cached
            self.counters.admitted += 1
        row = rec.req_pool_idx
        self.table.write(row, start, new_slots)
        deltas.append(SlotDelta(row, start, new_slots))
        rec.kv_allocated_len = end
        rec.kv_committed_len = end
        return ExtendGrant(rid, row, cached, start, end)

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
    async def alloc_decode(self, rids: list[int], deltas: list[SlotDelta]) -> int:
        """One slot for each request's next token, all or nothing.

        Returns 0 on success, else the number of pages still missing after eviction
        (nothing changed; the scheduler retracts and retries).
        """
        ps = self.page_size
        recs = self.check_decode(rids)
        need = sum(1 for rec in recs if rec.kv_allocated_len % ps == 0)
        short = await self._ensure_free(need)
        if short:
            return short
        fresh = self.pool.alloc(need)
        k = 0
        for rec in recs:
            pos = rec.kv_allocated_len
            if pos % ps == 0:
                slot = int(fresh[k]) * ps
                k += 1
            else:
                slot = int(self.table.table[rec.req_pool_idx, pos - 1]) + 1
            self.table.table[rec.req_pool_idx, pos] = slot
            deltas.append(SlotDelta(rec.req_pool_idx, pos, np.array([slot], dtype=np.int64)))
            rec.kv_allocated_len = pos + 1
            rec.kv_committed_len = pos + 1
        return 0

    def check_decode(self, rids: list[int]) -> list[ReqKvInfo]:
        """The held records of `rids`; raises `LedgerError` on misuse, changing nothing."""
        _require_unique(rids)
        recs = [self._held(rid) for rid in rids]
        for rid, rec in zip(rids, recs):
            if rec.kv_allocated_len >= self.table.row_capacity:
                raise LedgerError(f"request {rid}: context full ({rec.kv_allocated_len})")
        return recs

    # ---- chunked prefill: cache the finished pages of an unfinished request --------------
    async def cache_unfinished(self, rid: int, tokens: np.ndarray, deltas: list[SlotDelta]) -> None:
        """Insert the committed whole pages into the tree and move the lock there."""
        rec = self._held(rid)
        if self.tree is None:
            return
        aligned = floor_page(rec.kv_committed_len, self.page_size)
        if aligned <= rec.cache_protected_len:
            return
        row = rec.req_pool_idx
        slots = self.table.read(row, 0, aligned)
        res = await self.tree.insert(
            tokens[:aligned], slots, unlock_node=self.lock_nodes.pop(rid, None), lock_new=True
        )
        self.lock_nodes[rid] = res.node_id
        # Our slots for [protected, existing) duplicate the tree's: free ours, use the tree's.
        dup = slots[rec.cache_protected_len : res.existing_len]
        if dup.size:
            self.pool.free(pages_of_slots(dup, self.page_size))
            tree_part = res.slots[rec.cache_protected_len : res.existing_len]
            self.table.write(row, rec.cache_protected_len, tree_part)
            deltas.append(SlotDelta(row, rec.cache_protected_len, tree_part))
        rec.cache_protected_len = aligned

    # ---- release -------------------------------------------------------------------------
    async def finish(self, rid: int, tokens: np.ndarray | None) -> None:
        """Normal finish: committed whole pages go to the tree, the rest back to the pool."""
        await self._release(rid, tokens if self.tree is not None else None)
        self.counters.finished += 1

    async def abort(self, rid: int) -> None:
        """Abort at any stage; idempotent. Nothing is inserted into the tree."""
        rec = self.records.get(rid)
        if rec is not None and rec.is_held:
            await self._release(rid, None)
        self.counters.aborted += 1

    async def retract(self, rid: int, tokens: np.ndarray) -> None:
        """KV pressure: cache the computed prefix in the tree, free the rest, keep the record.

        The request goes back to the waiting queue; re-admission matches its prefix again.
        """
        await self._release(rid, tokens if self.tree is not None else None)
        self.counters.retracted += 1

    async def _release(self, rid: int, tokens: np.ndarray | None) -> None:
        rec = self._held(rid)
        ps = self.page_size
        row = rec.req_pool_idx
        slots = self.table.read(row, 0, rec.kv_allocated_len)
        node = self.lock_nodes.pop(rid, None)
        own_from = rec.cache_protected_len
        if tokens is not None:
            aligned = floor_page(rec.kv_committed_len, ps)
            if aligned > rec.cache_protected_len:
                res = await self.tree.insert(
                    tokens[:aligned], slots[:aligned], unlock_node=node, lock_new=False
                )
                node = None
                dup = slots[rec.cache_protected_len : res.existing_len]
                if dup.size:
                    self.pool.free(pages_of_slots(dup, ps))
                own_from = aligned
        if node is not None:
            await self.tree.unlock(node)
        tail = slots[own_from : rec.kv_allocated_len]
        if tail.size:
            self.pool.free(pages_of_slots(tail, ps))
        self.table.free_row(row)
        rec.req_pool_idx = None
        rec.mark_released()

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
        )

    async def check(self) -> None:
        check_invariants(await self.snapshot())

    async def idle_problems(self) -> list[str]:
        """The cheap conservation check of an idle engine (no request should hold anything):
        what is wrong, naming the owners, or []."""
        evictable = protected = 0
        if self.tree is not None:
            evictable, protected = await self.tree.sizes()
        problems = check_idle(
            free=self.pool.num_free,
            tree_pages=(evictable + protected) // self.page_size,
            total=self.pool.num_pages,
            records=len(self.records),
            held_rows=len(self.table.held_rows()),
            locked_tokens=protected,
        )
        if problems and self.records:
            owners = {
                rid: (rec.req_pool_idx, rec.kv_allocated_len)
                for rid, rec in list(self.records.items())[:8]
            }
            problems.append(f"records (rid: row, allocated): {owners}")
        return problems

    async def drop_cache(self) -> int:
        """Evict every page of the prefix tree (its KV contents are gone, e.g. the runner
        restarted); how many. Only with no record left: a live request may read those pages,
        so then `LedgerError` and nothing changes."""
        if self.records:
            raise LedgerError(f"{len(self.records)} requests still hold KV; end them first")
        if self.tree is None:
            return 0
        freed = await self.tree.evict(self.pool.num_pages)
        self.pool.free(freed)
        self.counters.evicted_pages += int(freed.size)
        return int(freed.size)

    def held_pages(self) -> int:
        """Pages owned by live requests (not the tree's shared prefix pages)."""
        ps = self.page_size
        return sum(
            ceil_page(r.kv_allocated_len, ps) // ps - r.cache_protected_len // ps
            for r in self.records.values()
            if r.is_held
        )

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
        """Make `pages` free, evicting from the tree if that suffices: 0, or the pages still
        missing counting every evictable one (then nothing was evicted)."""
        short = pages - self.pool.num_free
        if short <= 0:
            return 0
        evictable = await self.tree.evictable_pages() if self.tree is not None else 0
        if short > evictable:
            return short - evictable
        freed = await self.tree.evict(short)
        self.pool.free(freed)
        self.counters.evicted_pages += int(freed.size)
        return max(pages - self.pool.num_free, 0)

    async def _reserve_slots(
        self, start: int, end: int, last_slot: int | None
    ) -> np.ndarray | None:
        """Slots for positions [start, end): fill the open page after `last_slot`, then new
        pages."""
        ps = self.page_size
        n = end - start
        in_open_page = 0
        if start % ps and last_slot is not None:
            in_open_page = min(n, ps - start % ps)
        need_pages = ceil_page(n - in_open_page, ps) // ps
        if await self._ensure_free(need_pages):
            return None
        pages = self.pool.alloc(need_pages)
        rest = slots_of_pages(pages, ps)[: n - in_open_page]
        if not in_open_page:
            return rest
        head = np.arange(last_slot + 1, last_slot + 1 + in_open_page, dtype=np.int64)
        return np.concatenate([head, rest])


def _require_unique(rids: list[int]) -> None:
    seen: set[int] = set()
    twice = sorted({rid for rid in rids if rid in seen or seen.add(rid)})
    if twice:
        raise LedgerError(f"requests {twice[:8]} appear twice in one message")
