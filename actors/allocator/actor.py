"""The allocator actor: sole owner of every request's `ReqKvInfo`.

Wraps `KvLedger` in a mailbox, so every KV ownership transition (admission,
chunk, decode slot, cache-unfinished, finish, abort, retract, session save,
restore and close) happens here, one message at a time. Each message carries a
whole step's requests. In debug mode the invariant checker runs after every
mutating message.

The one ledger operation that starts beside the mailbox is a spill's second phase: the
runner writes a disk-tier file while the mailbox serves on, and the write's end
(`KvLedger.spill_done`) takes the same lock as a message, so it runs between two
messages, never inside one.
"""

from __future__ import annotations

import anyio
import msgspec
import numpy as np

from actors.allocator.ledger import KvLedger, SlotDelta, SwaMapDelta
from actors.allocator.remote_port import RemotePrefixPort
from actors.allocator.tier_port import RemoteTierPort
from actors.runtime import Actor, RemoteError
from kvcore import InvariantViolation, PagePool, ReqToTokenTable, SwaPages
from kvcore.req_kv_info import enable_write_guard
from kvcore.tiers import KvTier, PrefixIndex, TierEntry
from transport.channel import ChannelClosed
from transport.messages.alloc import (
    AllocDecode,
    AllocDecodeReply,
    AllocExtend,
    AllocExtendReply,
    CacheUnfinished,
    CacheUnfinishedReply,
    CloseSlots,
    CloseSlotsReply,
    DraftCommit,
    DropCache,
    DropCacheReply,
    ExtendGrantItem,
    IdleCheck,
    IdleCheckReply,
    KvStats,
    KvStatsRequest,
    OffloadSlot,
    OffloadSlotReply,
    OpenSlot,
    PersistSlots,
    PersistSlotsReply,
    PrefetchSlot,
    PrefetchSlotReply,
    ReleaseBatch,
    ReleaseKind,
    RestoreSlots,
    RestoreSlotsReply,
    SlotDeltas,
    SlotStats,
    SlotStatsRequest,
    StageSlot,
    StageSlotReply,
)


def pack_deltas(deltas: list[SlotDelta | SwaMapDelta]) -> SlotDeltas:
    """One message's deltas. Map changes are applied as one indexed write on the runner,
    so each full page appears once, with its last value in `deltas` order (an unmapping
    followed by a new mapping of the same page keeps the mapping)."""
    if not deltas:
        return SlotDeltas()
    rows = [d for d in deltas if isinstance(d, SlotDelta)]
    maps = [d for d in deltas if isinstance(d, SwaMapDelta)]
    full = swa = np.zeros(0, dtype=np.int64)
    if maps:
        full = np.concatenate([d.full_pages for d in maps])
        swa = np.concatenate([d.swa_pages for d in maps])
        _, last_from_end = np.unique(full[::-1], return_index=True)
        keep = np.sort(len(full) - 1 - last_from_end)
        full, swa = full[keep], swa[keep]
    return SlotDeltas(
        rows=[d.row for d in rows],
        starts=[d.start for d in rows],
        lengths=[len(d.slots) for d in rows],
        slots=np.concatenate([d.slots for d in rows]).tolist() if rows else [],
        swa_full_pages=full.tolist(),
        swa_pages=swa.tolist(),
    )


class AllocatorActor(Actor):
    inbox = (
        AllocExtend
        | AllocDecode
        | CacheUnfinished
        | ReleaseBatch
        | IdleCheck
        | KvStatsRequest
        | DropCache
        | OpenSlot
        | CloseSlots
        | SlotStatsRequest
        | OffloadSlot
        | PrefetchSlot
        | StageSlot
        | PersistSlots
        | RestoreSlots
    )

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_rows: int,
        row_capacity: int,
        radix: str | None = "radix",
        debug_checks: bool = False,
        swa_num_pages: int = 0,
        sliding_window: int = 0,
        swa_free_step: int = 64,
        swa_free_prompt: bool = False,
        session_max_pages: int | None = None,
        host_tier_bytes: int = 0,
        disk_tier_bytes: int = 0,
        disk_read_ahead_bytes: int = 32 << 20,  # StageSlot reads entries this big ahead
        tier_prefix_blocks: bool = False,
        runner: str = "runner",
    ) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.table = ReqToTokenTable(max_rows, row_capacity)
        # Sliding layers' own pool, freed as the window passes (0 pages: one shared pool).
        self.swa = (
            SwaPages(num_pages, swa_num_pages, page_size)
            if swa_num_pages and sliding_window
            else None
        )
        self.sliding_window = sliding_window if self.swa is not None else 0
        self.swa_free_step = max(swa_free_step, page_size)
        self.swa_free_prompt = swa_free_prompt
        self.radix_name = radix
        self.debug_checks = debug_checks
        self.session_max_pages = session_max_pages
        # The host tier below the pool (0: none); its bytes live in the runner's store.
        self.host_tier_bytes = host_tier_bytes
        # The disk tier below it (0: none; the runner writes its files under kv.store_dir).
        self.disk_tier_bytes = disk_tier_bytes if host_tier_bytes else 0
        self.disk_read_ahead_bytes = disk_read_ahead_bytes
        # Evicted prefix-tree blocks go to the tiers too (needs the tree and a host tier).
        self.tier_prefix_blocks = tier_prefix_blocks and bool(host_tier_bytes) and bool(radix)
        self.runner_name = runner
        if debug_checks:
            enable_write_guard()  # a record written outside the ledger raises
        self.ledger: KvLedger | None = None
        self.port: RemotePrefixPort | None = None
        self.idle_checks = 0
        self.idle_check_failures = 0
        self.disk_reads_ahead = 0  # StageSlot answered staged
        self._ledger_lock = anyio.Lock()  # a message's handling, or a spill's end

    async def on_start(self) -> None:
        self.port = (
            RemotePrefixPort(self.ref(self.radix_name), self.pool.page_size)
            if self.radix_name
            else None
        )
        self.port_tiers = (
            RemoteTierPort(self.ref(self.runner_name)) if self.host_tier_bytes else None
        )
        self.ledger = KvLedger(
            self.pool,
            self.table,
            self.port,
            swa=self.swa,
            window=self.sliding_window,
            swa_free_step=self.swa_free_step,
            swa_free_prompt=self.swa_free_prompt,
            session_max_pages=self.session_max_pages,
            tiers=self.port_tiers,
            host=KvTier("host", self.host_tier_bytes) if self.host_tier_bytes else None,
            disk=KvTier("disk", self.disk_tier_bytes) if self.disk_tier_bytes else None,
            prefix_blocks=PrefixIndex(self.pool.page_size) if self.tier_prefix_blocks else None,
        )
        if self.port_tiers is not None:
            self.ledger.spill_later = self._spill_later

    def _spill_later(self, handle: int) -> None:
        self.spawn(self._write_file, handle)

    async def _write_file(self, handle: int) -> None:
        """A spill's second phase: the runner writes the entry's file beside the steps; its
        end is applied between two messages."""
        try:
            nbytes = await self.port_tiers.spill(handle)
        except Exception as exc:  # whatever went wrong, the ledger hears of it
            # A drop that overtook the write is no failure; spill_done tells them apart.
            self.log.info("a disk-tier write did not complete", handle=handle, error=str(exc))
            nbytes = None
        async with self._ledger_lock:
            await self.ledger.spill_done(handle, nbytes)
            if self.debug_checks:
                await self.ledger.check()

    async def handle(self, msg, sender):
        async with self._ledger_lock:
            return await self._handle(msg)

    async def _handle(self, msg):
        # Every batched message is all or nothing: its items are checked before any is
        # applied, so a bad item (LedgerError) leaves the whole message undone.
        ledger = self.ledger
        if isinstance(msg, AllocDecode):
            drafts = list(msg.drafts) or None
            ledger.check_decode(list(msg.rids), drafts, self._check_commits(msg.commits))
            await self._commit(msg.commits)
            deltas: list[SlotDelta] = []
            short = await ledger.alloc_decode(list(msg.rids), deltas, drafts)
            reply = AllocDecodeReply(short_pages=short, deltas=pack_deltas(deltas))
        elif isinstance(msg, AllocExtend):
            reply = await self._extend(msg)
        elif isinstance(msg, CacheUnfinished):
            ledger.check_held(list(msg.rids))
            deltas = []
            for rid, toks in zip(msg.rids, msg.tokens):
                await ledger.cache_unfinished(rid, np.asarray(toks, dtype=np.int64), deltas)
            reply = CacheUnfinishedReply(deltas=pack_deltas(deltas))
        elif isinstance(msg, ReleaseBatch):
            await self._release(msg)
            reply = None
        elif isinstance(msg, IdleCheck):
            return await self._idle_check()
        elif isinstance(msg, KvStatsRequest):
            return await self._stats(msg.check_invariants, msg.reclaimable)
        elif isinstance(msg, OpenSlot):
            ledger.open_slot(msg.session_id, msg.priority, msg.retain_s)
            reply = None
        elif isinstance(msg, CloseSlots):
            reply = CloseSlotsReply(pages=await ledger.close_slots(list(msg.session_ids)))
        elif isinstance(msg, PersistSlots):
            reply = await self._persist(msg)
        elif isinstance(msg, RestoreSlots):
            reply = await self._restore()
        elif isinstance(msg, StageSlot):
            entry = ledger.spilled_entry(msg.session_id)
            if entry is None or entry.nbytes < self.disk_read_ahead_bytes:
                return StageSlotReply(staged=False)
            return self.reply_later(self._stage, entry.handle)
        elif isinstance(msg, PrefetchSlot):
            reply = PrefetchSlotReply(pool_tokens=await ledger.prefetch_slot(msg.session_id))
        elif isinstance(msg, OffloadSlot):
            pages, stored = await ledger.offload_slot(msg.session_id)
            reply = OffloadSlotReply(pages=pages, stored_tokens=stored)
        elif isinstance(msg, SlotStatsRequest):
            slot = ledger.slots.get(msg.session_id)
            return SlotStats(
                held_tokens=ledger.slot_tokens(msg.session_id),
                pool_tokens=slot.rec.kv_committed_len if slot and slot.rec else 0,
            )
        elif isinstance(msg, DropCache):
            dropped = await ledger.drop_cache()
            self.log.warning("prefix cache dropped", pages=dropped)
            return DropCacheReply(dropped_pages=dropped, problems=await ledger.idle_problems())
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        if self.debug_checks:
            await ledger.check()
        return reply

    async def _stage(self, handle: int) -> StageSlotReply:
        """The runner reads the entry ahead, beside the mailbox (which serves on)."""
        assert self.port_tiers is not None
        try:
            staged = await self.port_tiers.stage(handle)
            self.disk_reads_ahead += staged
            return StageSlotReply(staged=staged)
        except (TimeoutError, RemoteError, ChannelClosed) as exc:
            self.log.warning("a read-ahead failed; the load reads the file", error=str(exc))
            return StageSlotReply(staged=False)

    async def _extend(self, msg: AllocExtend) -> AllocExtendReply:
        ledger = self.ledger
        ledger.check_held([item.rid for item in msg.items], [False] * len(msg.items))
        for item in msg.items:
            ledger.check_extend(item.rid, len(item.tokens), item.budget)
        deltas: list[SlotDelta] = []
        grants = []
        for item in msg.items:
            toks = np.asarray(item.tokens, dtype=np.int64)
            g = await ledger.alloc_extend(
                item.rid,
                toks,
                item.budget,
                deltas,
                match_prefix=item.match_prefix,
                session=item.session_id,
                cache_salt=item.cache_salt,
            )
            if g is None:
                grants.append(ExtendGrantItem(rid=item.rid, row=-1, cached_len=0, start=0, end=0))
            else:
                grants.append(
                    ExtendGrantItem(
                        rid=g.rid, row=g.row, cached_len=g.cached_len, start=g.start, end=g.end
                    )
                )
        return AllocExtendReply(grants=grants, deltas=pack_deltas(deltas))

    async def _persist(self, msg: PersistSlots) -> PersistSlotsReply:
        """Drain: the idle sessions' KV to the disk tier, and the runner's manifest of them
        (a restart with the same kv.store_dir finds them)."""
        if self.ledger.disk is None:
            return PersistSlotsReply(persisted=0)
        meta = {s.session_id: s for s in msg.sessions}
        kept = await self.ledger.persist_sessions(list(meta))
        sessions = [
            msgspec.structs.replace(
                meta[sid],
                handle=entry.handle,
                tokens_keys=entry.tokens.tolist(),
                alive=entry.alive.tolist() if entry.alive is not None else [],
                nbytes=entry.nbytes,
            )
            for sid, entry in kept
        ]
        await self.port_tiers.persist(sessions)
        self.log.info("sessions persisted", sessions=len(sessions), of_idle=len(meta))
        return PersistSlotsReply(persisted=len(sessions))

    async def _restore(self) -> RestoreSlotsReply:
        """Start: the sessions a previous run persisted, as slots naming disk-tier entries."""
        if self.ledger.disk is None:
            return RestoreSlotsReply(sessions=[])
        found = await self.port_tiers.restore()
        entries = [
            (
                s.session_id,
                TierEntry(
                    s.handle,
                    np.asarray(s.tokens_keys, dtype=np.int64),
                    np.asarray(s.alive, dtype=bool) if s.alive else None,
                    s.nbytes,
                ),
            )
            for s in found
        ]
        refused = self.ledger.restore_sessions(entries)
        if refused:
            await self.port_tiers.drop(refused)
        kept = [s for s in found if s.handle not in set(refused)]
        for s in kept:
            self.ledger.hint_slot(s.session_id, s.priority, s.retain_s)
        self.log.info("sessions restored", sessions=len(kept), refused=len(refused))
        return RestoreSlotsReply(sessions=kept)

    def _check_commits(self, commits: list[DraftCommit]) -> dict[int, int]:
        """rid -> accepted positions, every commit checked (`LedgerError` changes nothing)."""
        ledger = self.ledger
        ledger.check_held([c.rid for c in commits])
        for c in commits:
            ledger.check_commit(c.rid, c.accepted)
        return {c.rid: c.accepted for c in commits}

    async def _commit(self, commits: list[DraftCommit]) -> None:
        """Commit speculative steps' accepted positions (checked by `_check_commits`)."""
        for c in commits:
            await self.ledger.commit_draft(c.rid, c.accepted)

    async def _release(self, msg: ReleaseBatch) -> None:
        ledger = self.ledger
        committing = self._check_commits(msg.commits)
        ledger.check_held(
            [item.rid for item in msg.items],
            [item.kind is not ReleaseKind.ABORT for item in msg.items],
        )
        for item in msg.items:
            if item.kind is not ReleaseKind.ABORT:
                ledger.require_at_rest(item.rid, committing)
        await self._commit(msg.commits)
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

    async def _idle_check(self) -> IdleCheckReply:
        """Always on (it only counts); with debug checks a failure also raises."""
        self.idle_checks += 1
        problems = await self.ledger.idle_problems(audit_store=True)
        if problems:
            self.idle_check_failures += 1
            self.log.error("KV not balanced at idle", problems=problems)
            if self.debug_checks:
                raise InvariantViolation("KV not balanced at idle: " + "; ".join(problems))
        elif self.debug_checks:
            await self.ledger.check()
        return IdleCheckReply(problems=problems)

    async def _stats(self, check: bool, reclaimable: bool = False) -> KvStats:
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
            session_pages=ledger.session_pages(),
            evictable_pages=evictable,
            reclaimable_pages=(await ledger.reclaimable_pages() if check or reclaimable else 0),
            records=len(ledger.records),
            held_rows=len(self.table.held_rows()),
            cache_hit_tokens=c.cache_hit_tokens,
            evicted_pages=c.evicted_pages,
            admitted=c.admitted,
            finished=c.finished,
            aborted=c.aborted,
            retracted=c.retracted,
            idle_checks=self.idle_checks,
            idle_check_failures=self.idle_check_failures,
            swa_total_pages=self.swa.num_pages if self.swa is not None else 0,
            swa_free_pages=self.swa.num_free if self.swa is not None else 0,
            swa_freed_pages=c.swa_freed_pages,
            sessions_open=len(ledger.slots),
            session_slots=sum(1 for s in ledger.slots.values() if s.rec is not None),
            session_hit_tokens=c.session_hit_tokens,
            swa_keeps_prompt=self.swa is not None and not self.swa_free_prompt,
            session_reclaims=c.session_reclaims,
            tree_heals=c.tree_heals,
            session_demotes=c.session_demotes,
            session_promotes=c.session_promotes,
            promoted_tokens=c.promoted_tokens,
            tier_drops=c.tier_drops,
            tier_failures=c.tier_failures,
            host_tier_budget=self.host_tier_bytes,
            host_tier_bytes=ledger.host.used if ledger.host is not None else 0,
            host_tier_entries=ledger.session_entries("host"),
            stored_tokens=ledger.stored_tokens(),
            disk_tier_budget=self.disk_tier_bytes,
            disk_tier_bytes=ledger.disk.used if ledger.disk is not None else 0,
            disk_tier_entries=ledger.session_entries("disk"),
            tier_spills=c.tier_spills,
            disk_promotes=c.disk_promotes,
            prefix_blocks=len(ledger.prefix_blocks) if ledger.prefix_blocks is not None else 0,
            block_demotes=c.block_demotes,
            block_promotes=c.block_promotes,
            block_loaded_tokens=c.block_loaded_tokens,
            disk_reads_ahead=self.disk_reads_ahead,
            disk_tier_writing=len(ledger.writing),
        )

    def stats(self) -> dict[str, int | float]:
        return {"kv_free_pages": self.pool.num_free, "kv_total_pages": self.pool.num_pages}
