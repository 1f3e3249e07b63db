"""The invariant checker: audits the allocator's whole state at once (DESIGN.md 1-4).

It must be exact: a false positive would stop a healthy engine, a blind spot lets a real
leak through. Checked, for every holder (a live request or a session slot) with row R:

1. Order: 0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <= row capacity;
   cache_protected_len is page-aligned; `not is_held == is_released` (the checker runs
   between operations, where every record is at a release point). A live request's
   committed length trails its allocated one only between a speculative step's reservation
   and its commit; a session slot's record is at rest (committed == allocated).
2. Layout: the slot of every position p < kv_allocated_len lies at in-page offset
   p % page_size, every logical page of the row (positions [k*ps, (k+1)*ps)) lies on one
   physical page, never the padding page 0, and no two logical pages share one.
3. The protected prefix R[0 : cache_protected_len) is exactly the slot path, in the prefix
   tree, of the node the holder locks (so it is tree KV of the holder's own lock, not of
   other tokens); a holder with a protected prefix holds such a lock.
4. The tree: every node holds whole pages, each at offsets 0..ps-1; each node's lock_ref
   equals the number of live locks at or below it; protected_size / evictable_size equal
   the sizes of the locked / unlocked nodes.
5. Conservation: free + tree + requests + sessions == total pages, counted page by page
   with no de-duplication inside an owner, so a page owned twice (even by one owner) or
   lost is named.
6. Locks have owners: every tree lock entry belongs to a live request holding a row, or to
   a session slot holding a record; nothing else may lock.
7. Sliding window (split pools): a bijection between mapped full pages and used sliding
   pages; every page the holder's next query reads (positions from
   kv_committed_len - window on, tree prefix included) has its sliding KV; the tree's
   per-page alive flags equal the map; a holder's own pages below its floor are alive and
   [floor, swa_evicted_seqlen) is dead.
8. Tiers: every entry of a tier below the pool is in one tier and has one owner: a session
   slot that holds no pool record, or the prefix index; each tier's bytes are its
   entries' and within its budget (`kvcore.tiers`).

Failures raise `InvariantViolation` naming the owner and the pages. `check_idle` is the
cheap check for an idle engine (counts only).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvcore.radix_tree import RadixTree, TreeSnapshot
from kvcore.req_kv_info import ReqKvInfo
from kvcore.slots import floor_page
from kvcore.tiers import KvTier, PrefixIndex, TierViolation, check_tiers


class InvariantViolation(AssertionError):
    pass


@dataclass(frozen=True)
class KvSnapshot:
    page_size: int
    total_pages: int
    free_pages: np.ndarray
    table: np.ndarray  # req-to-token rows, indexed by req_pool_idx
    held_rows: np.ndarray  # rows the table marks as handed out
    records: Mapping[object, ReqKvInfo]  # live requests, by request id
    tree: TreeSnapshot | None = None  # None: prefix caching off
    lock_nodes: Mapping[object, int] = field(default_factory=dict)  # request id -> locked node
    session_records: Mapping[object, ReqKvInfo] = field(default_factory=dict)
    session_lock_nodes: Mapping[object, int] = field(default_factory=dict)
    # The sliding layers' pool (None: they share the full pool): full page -> sliding page.
    swa_map: np.ndarray | None = None
    swa_free_pages: np.ndarray | None = None
    swa_total_pages: int = 0
    swa_window: int = 0  # the sliding layers' window in tokens (0: none)
    tiers: list[KvTier] = field(default_factory=list)  # the tiers below the pool
    session_entries: Mapping[object, int] = field(default_factory=dict)  # session -> handle
    prefix_blocks: PrefixIndex | None = None  # the owner of the prefix blocks in the tiers


def row_pages(rec: ReqKvInfo, table: np.ndarray, page_size: int, start: int) -> np.ndarray:
    """Physical page of every logical page of a held row from position `start` (a page
    boundary) to kv_allocated_len, one entry per logical page."""
    if rec.req_pool_idx is None or rec.kv_allocated_len <= start:
        return np.zeros(0, dtype=np.int64)
    slots = table[rec.req_pool_idx, start : rec.kv_allocated_len : page_size]
    return np.asarray(slots, dtype=np.int64) // page_size


def owned_pages(rec: ReqKvInfo, table: np.ndarray, page_size: int) -> np.ndarray:
    """Pages a held record owns itself: those of row[cache_protected_len : kv_allocated_len)."""
    return row_pages(rec, table, page_size, rec.cache_protected_len)


def check_invariants(snap: KvSnapshot) -> None:
    ps = snap.page_size
    capacity = snap.table.shape[1]
    owners: dict[str, np.ndarray] = {"free list": np.asarray(snap.free_pages, dtype=np.int64)}
    tree_path = _check_tree(snap, owners)
    rows_seen: dict[int, str] = {}
    held_rows = set(np.asarray(snap.held_rows).tolist())

    holders = [(f"request {rid!r}", r, snap.lock_nodes.get(rid)) for rid, r in snap.records.items()]
    holders += [
        (f"session {sid!r}", r, snap.session_lock_nodes.get(sid))
        for sid, r in snap.session_records.items()
    ]
    for who, rec, lock in holders:
        _check_record(who, rec, capacity, ps)
        if who.startswith("session") and rec.kv_committed_len != rec.kv_allocated_len:
            raise InvariantViolation(
                f"{who}: saved with {rec.kv_allocated_len - rec.kv_committed_len} draft slots "
                "not committed (a release point needs committed == allocated)"
            )
        if rec.req_pool_idx is None:
            if lock is not None:
                raise InvariantViolation(f"{who} holds no row but still locks tree node {lock}")
            continue
        row = rec.req_pool_idx
        if row in rows_seen:
            raise InvariantViolation(f"{who} and {rows_seen[row]} both hold row {row}")
        rows_seen[row] = who
        if row not in held_rows:
            raise InvariantViolation(f"{who} holds row {row}, which the table marks free")
        _check_layout(who, snap.table[row, : rec.kv_allocated_len], ps)
        _check_protected(who, rec, lock, snap, tree_path)
        owners[who] = owned_pages(rec, snap.table, ps)

    stray_rows = sorted(held_rows - set(rows_seen))
    if stray_rows:
        raise InvariantViolation(f"rows {stray_rows[:8]} are held by no request or session")
    _check_lock_owners(snap)
    _check_tree_locks(snap)
    _check_conservation(snap, owners)
    if snap.swa_map is not None:
        _check_swa(snap, holders)
    if snap.tiers:
        try:
            check_tiers(
                snap.tiers,
                snap.session_entries,
                set(snap.session_records),
                prefix_blocks=snap.prefix_blocks,
            )
        except TierViolation as exc:
            raise InvariantViolation(str(exc)) from None


def check_idle(
    *,
    free: int,
    tree_pages: int,
    total: int,
    records: int,
    held_rows: int,
    locked_tokens: int,
    session_pages: int = 0,
    session_rows: int = 0,
    session_locked_tokens: int = 0,
    turns: int = 0,
    request_locks: int = 0,
    orphan_session_locks: int = 0,
) -> list[str]:
    """The cheap check of an idle engine, where only session slots may hold KV: what is
    wrong, or [] (counts only, no walk). Sessions may share locked tree prefixes, so their
    `session_locked_tokens` (the sum of their protected lengths) bound the locked size."""
    problems = []
    if records:
        problems.append(f"{records} request records left")
    if turns:
        problems.append(f"{turns} session turns still open")
    if request_locks:
        problems.append(f"{request_locks} tree locks of requests left")
    if orphan_session_locks:
        problems.append(f"{orphan_session_locks} tree locks of sessions holding no KV")
    if held_rows != session_rows:
        problems.append(f"{held_rows} rows held, {session_rows} by sessions")
    if locked_tokens > session_locked_tokens or (session_locked_tokens and not locked_tokens):
        problems.append(
            f"{locked_tokens} tree tokens locked, sessions protect {session_locked_tokens}"
        )
    if free + tree_pages + session_pages != total:
        problems.append(
            f"free {free} + tree {tree_pages} + sessions {session_pages} != total {total} pages"
        )
    return problems


def _check_record(who: str, rec: ReqKvInfo, capacity: int, ps: int) -> None:
    p, c, a = rec.cache_protected_len, rec.kv_committed_len, rec.kv_allocated_len
    if not (0 <= p <= c <= a <= capacity):
        raise InvariantViolation(
            f"{who}: expected 0 <= protected {p} <= committed {c} <= allocated {a} <= {capacity}"
        )
    if p % ps:
        raise InvariantViolation(f"{who}: cache_protected_len {p} is not page-aligned ({ps})")
    if (not rec.is_held) != rec.is_released:
        raise InvariantViolation(
            f"{who}: is_held={rec.is_held} but is_released={rec.is_released} ({rec})"
        )
    if rec.is_held and not (0 <= rec.swa_evicted_seqlen <= a):
        raise InvariantViolation(f"{who}: swa_evicted_seqlen {rec.swa_evicted_seqlen} > {a}")


def _check_layout(who: str, slots: np.ndarray, ps: int) -> None:
    """Position p sits at offset p % ps, one physical page per logical page, none on page 0."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size == 0:
        return
    positions = np.arange(slots.size)
    off = np.nonzero(slots % ps != positions % ps)[0]
    if off.size:
        p = int(off[0])
        raise InvariantViolation(
            f"{who}: position {p} is at slot {int(slots[p])}, in-page offset {int(slots[p]) % ps} "
            f"instead of {p % ps}"
        )
    pages = slots // ps
    split = np.nonzero(pages != pages[positions - positions % ps])[0]
    if split.size:
        p = int(split[0])
        raise InvariantViolation(
            f"{who}: logical page {p // ps} spans physical pages "
            f"{int(pages[p - p % ps])} and {int(pages[p])}"
        )
    if (pages < 1).any():
        p = int(np.nonzero(pages < 1)[0][0])
        raise InvariantViolation(f"{who}: position {p} points into the padding page 0")


def _check_protected(
    who: str, rec: ReqKvInfo, lock: int | None, snap: KvSnapshot, tree_path
) -> None:
    protected = rec.cache_protected_len
    if protected == 0:
        if lock is not None and snap.tree is not None:
            path = tree_path(lock)
            if path is not None and path.size:
                raise InvariantViolation(f"{who} locks tree node {lock} but protects no prefix")
        return
    if snap.tree is None:
        raise InvariantViolation(f"{who}: protected prefix {protected} with prefix caching off")
    if lock is None:
        raise InvariantViolation(
            f"{who}: protected prefix [0, {protected}) but the request locks no tree node"
        )
    path = tree_path(lock)
    if path is None:
        raise InvariantViolation(f"{who} locks tree node {lock}, which is not in the tree")
    row = snap.table[rec.req_pool_idx, :protected]
    if path.size != protected or not np.array_equal(path, row):
        differ = np.nonzero(path[: min(path.size, protected)] != row[: path.size])[0]
        at = int(differ[0]) if differ.size else min(path.size, protected)
        raise InvariantViolation(
            f"{who}: protected prefix [0, {protected}) is not the slot path of its locked node "
            f"{lock} ({path.size} tokens; first difference at position {at})"
        )


def _check_tree(snap: KvSnapshot, owners: dict[str, np.ndarray]):
    """Check the tree's pages; returns node_id -> its root path slots (None: no such node)."""
    tree = snap.tree
    if tree is None:
        return lambda node_id: None
    ps = snap.page_size
    index = {nid: i for i, nid in enumerate(tree.ids)}
    pages: list[np.ndarray] = []
    for i, nid in enumerate(tree.ids):
        value = np.asarray(tree.values[i], dtype=np.int64)
        if value.size != len(tree.keys[i]) or value.size % ps:
            raise InvariantViolation(
                f"tree node {nid}: {value.size} slots for {len(tree.keys[i])} tokens "
                f"(page size {ps})"
            )
        _check_layout(f"tree node {nid}", value, ps)
        pages.append(value[::ps] // ps)
    owners["prefix tree"] = np.concatenate(pages) if pages else np.zeros(0, dtype=np.int64)

    def path_of(node_id: int) -> np.ndarray | None:
        if node_id != RadixTree.ROOT_ID and node_id not in index:
            return None
        return tree.path_slots(node_id)

    return path_of


def _check_lock_owners(snap: KvSnapshot) -> None:
    """A lock entry of a request without a held record, or of a session without a held
    slot record, is a lock nobody will ever release."""
    for rid in snap.lock_nodes:
        rec = snap.records.get(rid)
        if rec is None or not rec.is_held:
            raise InvariantViolation(
                f"tree node {snap.lock_nodes[rid]} is locked for request {rid!r}, which holds no KV"
            )
    for sid in snap.session_lock_nodes:
        rec = snap.session_records.get(sid)
        if rec is None or not rec.is_held:
            raise InvariantViolation(
                f"tree node {snap.session_lock_nodes[sid]} is locked for session {sid!r}, "
                "which holds no KV"
            )


def _check_tree_locks(snap: KvSnapshot) -> None:
    """Each node's lock_ref is the number of live locks at or below it, and the tree's sizes
    follow from them."""
    tree = snap.tree
    if tree is None:
        return
    index = {nid: i for i, nid in enumerate(tree.ids)}
    # Expected lock_ref of a node: the live locks at or below it.
    expected: Counter[int] = Counter()
    locks = [*snap.lock_nodes.items(), *snap.session_lock_nodes.items()]
    for who, node in locks:
        if node != RadixTree.ROOT_ID and node not in index:
            raise InvariantViolation(f"{who!r} locks tree node {node}, which is not in the tree")
        while node != RadixTree.ROOT_ID:
            expected[node] += 1
            node = tree.parents[index[node]]
    protected = 0
    for i, nid in enumerate(tree.ids):
        if tree.lock_refs[i] != expected[nid]:
            raise InvariantViolation(
                f"tree node {nid}: lock_ref {tree.lock_refs[i]} but {expected[nid]} live locks "
                "at or below it"
            )
        if expected[nid]:
            protected += len(tree.keys[i])
    total = sum(len(k) for k in tree.keys)
    if tree.protected_size != protected or tree.evictable_size != total - protected:
        raise InvariantViolation(
            f"tree sizes protected {tree.protected_size} / evictable {tree.evictable_size} "
            f"disagree with the live locks ({protected} / {total - protected})"
        )


def _check_conservation(snap: KvSnapshot, owners: dict[str, np.ndarray]) -> None:
    seen: dict[int, str] = {}
    total = 0
    for who, pages in owners.items():
        total += len(pages)
        for p in pages.tolist():
            if p < 1 or p > snap.total_pages:
                raise InvariantViolation(f"{who} owns page {p}, outside 1..{snap.total_pages}")
            other = seen.get(p)
            if other is not None:
                if other == who:
                    raise InvariantViolation(f"page {p} is owned twice by {who}")
                raise InvariantViolation(f"page {p} is owned by both {other} and {who}")
            seen[p] = who
    if total != snap.total_pages:
        counts = {who: len(pages) for who, pages in owners.items()}
        missing = sorted(set(range(1, snap.total_pages + 1)) - set(seen))
        raise InvariantViolation(
            f"conservation broken: {counts} sum to {total}, total is {snap.total_pages}; "
            f"leaked pages {missing[:16]}"
        )


def swa_idle_problems(swa, full_free_pages: np.ndarray) -> list[str]:
    """The sliding pool at idle: each sliding page free or mapped from a full page in use
    (the tree's or a session's), never from a free full page."""
    problems = []
    stale = np.asarray(full_free_pages, dtype=np.int64)
    stale = stale[swa.map[stale] > 0]
    if stale.size:
        problems.append(f"free full pages {stale[:8].tolist()} still have sliding pages")
    mapped = int((swa.map > 0).sum())
    if mapped + swa.num_free != swa.num_pages:
        problems.append(f"sliding pages: {mapped} mapped + {swa.num_free} free != {swa.num_pages}")
    return problems


def _check_swa(snap: KvSnapshot, holders) -> None:
    """The sliding pool: a bijection between mapped full pages and the sliding pages not
    free; free full pages map to nothing; each holder's own pages have sliding KV except
    [max(protected, ceil_page(swa_evict_floor)), swa_evicted_seqlen), which has none."""
    ps = snap.page_size
    smap = np.asarray(snap.swa_map, dtype=np.int64)
    if smap[0] != 0:
        raise InvariantViolation("the padding page 0 maps to a sliding page")
    used = smap[smap > 0]
    if used.size != np.unique(used).size:
        counts = Counter(used.tolist())
        twice = sorted(p for p, c in counts.items() if c > 1)
        raise InvariantViolation(f"sliding pages {twice[:8]} are mapped from two full pages")
    free = np.asarray(snap.swa_free_pages, dtype=np.int64)
    both = np.intersect1d(free, used)
    if both.size:
        raise InvariantViolation(f"sliding pages {both[:8].tolist()} are mapped and free")
    if used.size + free.size != snap.swa_total_pages or (used > snap.swa_total_pages).any():
        raise InvariantViolation(
            f"sliding pool: {used.size} mapped + {free.size} free != {snap.swa_total_pages}"
        )
    full_free = np.asarray(snap.free_pages, dtype=np.int64)
    stale = full_free[smap[full_free] > 0]
    if stale.size:
        raise InvariantViolation(f"free full pages {stale[:8].tolist()} have sliding pages")
    tree = snap.tree
    if tree is not None and tree.alive:
        for nid, value, alive in zip(tree.ids, tree.values, tree.alive):
            pages = np.asarray(value[::ps], dtype=np.int64) // ps
            wrong = np.flatnonzero((smap[pages] > 0) != np.asarray(alive, dtype=bool))
            if wrong.size:
                k = int(wrong[0])
                raise InvariantViolation(
                    f"tree node {nid}: page {int(pages[k])} is marked "
                    f"{'alive' if alive[k] else 'dead'} but its sliding page is "
                    f"{int(smap[pages[k]])}"
                )
    for who, rec, _lock in holders:
        if rec.req_pool_idx is None:
            continue
        if snap.swa_window:
            # The next query (at kv_committed_len at the latest) reads from here on, over
            # the whole row: the tree's prefix as much as the holder's own pages.
            start = floor_page(max(rec.kv_committed_len - snap.swa_window, 0), ps)
            pages = row_pages(rec, snap.table, ps, start)
            if pages.size and (smap[pages] == 0).any():
                k = int(np.flatnonzero(smap[pages] == 0)[0])
                raise InvariantViolation(
                    f"{who}: position {start + k * ps} lies in the window its next query reads "
                    f"(from {rec.kv_committed_len - snap.swa_window}) but its page "
                    f"{int(pages[k])} has no sliding KV"
                )
        evicted = rec.swa_evicted_seqlen
        if evicted % ps:
            raise InvariantViolation(f"{who}: swa_evicted_seqlen {evicted} is not page-aligned")
        live_from = max(rec.cache_protected_len, evicted)
        pages = row_pages(rec, snap.table, ps, live_from)
        if pages.size and (smap[pages] == 0).any():
            k = int(np.flatnonzero(smap[pages] == 0)[0])
            raise InvariantViolation(
                f"{who}: position {live_from + k * ps} lost its sliding KV "
                f"(swa_evicted_seqlen {evicted})"
            )
        # [protected, ceil_page(floor)) is shielded; the window freed [that, evicted).
        shield = max(rec.cache_protected_len, -(-rec.swa_evict_floor // ps) * ps)
        row = snap.table[rec.req_pool_idx]
        kept = np.asarray(row[rec.cache_protected_len : min(shield, evicted) : ps], np.int64)
        if (smap[kept // ps] == 0).any():
            raise InvariantViolation(
                f"{who}: sliding KV below swa_evict_floor {rec.swa_evict_floor} was freed"
            )
        dead = np.asarray(row[shield:evicted:ps], dtype=np.int64)
        if (smap[dead // ps] != 0).any():
            raise InvariantViolation(
                f"{who}: sliding KV below swa_evicted_seqlen {evicted} is still mapped"
            )
