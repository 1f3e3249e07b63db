"""The invariant checker: audits the allocator's whole state at once (DESIGN.md 1-4).

1. Per record: 0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <= row
   capacity; cache_protected_len is page-aligned.
2. Release points: `not is_held == is_released` (checked for every record, since the
   checker runs between operations, where every record is at a release point).
3. Conservation: free + tree + live requests + session slots == total pages; no page is
   owned twice; no owned page is on the free list.
4. A holder owns row[cache_protected_len : kv_allocated_len) (whole pages); row[0 :
   cache_protected_len) lies in pages the tree owns.

Failures raise `InvariantViolation` naming the request and the pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvcore.req_kv_info import ReqKvInfo
from kvcore.slots import pages_of_slots


class InvariantViolation(AssertionError):
    pass


@dataclass(frozen=True)
class KvSnapshot:
    page_size: int
    total_pages: int
    free_pages: np.ndarray
    tree_pages: np.ndarray
    table: np.ndarray  # req-to-token rows, indexed by req_pool_idx
    held_rows: np.ndarray  # rows the table marks as handed out
    records: Mapping[object, ReqKvInfo]  # live requests, by request id
    session_records: Mapping[object, ReqKvInfo] = field(default_factory=dict)


def owned_pages(rec: ReqKvInfo, table: np.ndarray, page_size: int) -> np.ndarray:
    """Pages a held record owns itself: those of row[cache_protected_len : kv_allocated_len)."""
    if rec.req_pool_idx is None:
        return np.zeros(0, dtype=np.int64)
    row = table[rec.req_pool_idx]
    return pages_of_slots(row[rec.cache_protected_len : rec.kv_allocated_len], page_size)


def check_invariants(snap: KvSnapshot) -> None:
    ps = snap.page_size
    capacity = snap.table.shape[1]
    tree = np.asarray(snap.tree_pages, dtype=np.int64)
    free = np.asarray(snap.free_pages, dtype=np.int64)
    owners: dict[str, np.ndarray] = {"free list": free, "prefix tree": tree}
    rows_seen: dict[int, str] = {}
    tree_set = set(tree.tolist())
    held_rows = set(np.asarray(snap.held_rows).tolist())

    holders = [(f"request {rid!r}", r) for rid, r in snap.records.items()]
    holders += [(f"session {sid!r}", r) for sid, r in snap.session_records.items()]
    for who, rec in holders:
        _check_record(who, rec, capacity, ps)
        if rec.req_pool_idx is None:
            continue
        row = rec.req_pool_idx
        if row in rows_seen:
            raise InvariantViolation(f"{who} and {rows_seen[row]} both hold row {row}")
        rows_seen[row] = who
        if row not in held_rows:
            raise InvariantViolation(f"{who} holds row {row}, which the table marks free")
        prefix_pages = pages_of_slots(snap.table[row, : rec.cache_protected_len], ps)
        outside = [p for p in prefix_pages.tolist() if p not in tree_set]
        if outside:
            raise InvariantViolation(
                f"{who}: protected prefix [0, {rec.cache_protected_len}) uses pages {outside[:8]} "
                "that the prefix tree does not own"
            )
        owners[who] = owned_pages(rec, snap.table, ps)

    stray_rows = sorted(held_rows - set(rows_seen))
    if stray_rows:
        raise InvariantViolation(f"rows {stray_rows[:8]} are held by no request or session")

    seen: dict[int, str] = {}
    total = 0
    for who, pages in owners.items():
        total += len(pages)
        for p in pages.tolist():
            if p < 1 or p > snap.total_pages:
                raise InvariantViolation(f"{who} owns page {p}, outside 1..{snap.total_pages}")
            other = seen.get(p)
            if other is not None:
                raise InvariantViolation(f"page {p} is owned by both {other} and {who}")
            seen[p] = who
    if total != snap.total_pages:
        counts = {who: len(pages) for who, pages in owners.items()}
        missing = sorted(set(range(1, snap.total_pages + 1)) - set(seen))
        raise InvariantViolation(
            f"conservation broken: {counts} sum to {total}, total is {snap.total_pages}; "
            f"leaked pages {missing[:16]}"
        )


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
    if not (0 <= rec.swa_evicted_seqlen <= max(a, 0)) and rec.is_held:
        raise InvariantViolation(f"{who}: swa_evicted_seqlen {rec.swa_evicted_seqlen} > {a}")
