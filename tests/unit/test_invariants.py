"""The invariant checker has no blind spots: one corrupted snapshot per rule, each named.

Every case starts from a real, valid state built by the ledger (page size 4: a finished
request cached 3 pages, a second one matched them and holds its own pages) and corrupts
one thing in a copy of its snapshot.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvcore import InvariantViolation, ReqKvInfo, check_idle, check_invariants
from kvcore.req_kv_info import FIELDS, ledger_writes
from tests.unit.ledger_driver import make_ledger, run_sync

PS = 4


@pytest.fixture
def state():
    ledger, tree = make_ledger(16, PS, 4, capacity=64)
    first = np.arange(100, 113)  # 13 tokens: 3 whole pages go to the tree on finish
    run_sync(ledger.alloc_extend(1, first, 64, []))
    run_sync(ledger.finish(1, first))
    ledger.forget(1)
    second = np.concatenate([first[:12], [7, 8, 9, 10, 11, 12]])
    grant = run_sync(ledger.alloc_extend(2, second, 64, []))
    assert grant.cached_len == 12
    snap = run_sync(ledger.snapshot())
    check_invariants(snap)  # the starting point is valid
    return ledger, snap


def corrupt(snap, **changes):
    return dataclasses.replace(snap, **changes)


def with_fields(rec: ReqKvInfo, **changes) -> ReqKvInfo:
    """A planted record: `rec`'s fields with `changes` (tests may write records only
    inside `ledger_writes()`)."""
    with ledger_writes():
        return ReqKvInfo(**{f: getattr(rec, f) for f in FIELDS} | changes)


def table_copy(snap):
    return snap.table.copy()


def violation(snap, match):
    with pytest.raises(InvariantViolation, match=match):
        check_invariants(snap)


def test_two_tree_nodes_on_one_page(state):
    _, snap = state
    tree = snap.tree
    # A second node whose slots are those of the first node's first page.
    extra = dataclasses.replace(
        tree,
        ids=[*tree.ids, 99],
        parents=[*tree.parents, 0],
        keys=[*tree.keys, np.array([1, 2, 3, 4])],
        values=[*tree.values, tree.values[0][:PS].copy()],
        lock_refs=[*tree.lock_refs, 0],
        evictable_size=tree.evictable_size + PS,
    )
    violation(corrupt(snap, tree=extra), r"page \d+ is owned twice by prefix tree")


def test_two_logical_pages_of_a_request_on_one_physical_page(state):
    _, snap = state
    rec = snap.records[2]
    table = table_copy(snap)
    row = table[rec.req_pool_idx]
    row[16:20] = row[12:16]  # logical page 4 reuses logical page 3's physical page
    rec2 = with_fields(rec, kv_allocated_len=20, kv_committed_len=18)
    violation(corrupt(snap, table=table, records={2: rec2}), r"owned twice by request 2")


def test_two_positions_on_one_slot(state):
    _, snap = state
    rec = snap.records[2]
    table = table_copy(snap)
    table[rec.req_pool_idx, 13] = table[rec.req_pool_idx, 12]
    violation(corrupt(snap, table=table), "position 13 is at slot")


def test_a_position_off_its_in_page_offset(state):
    _, snap = state
    rec = snap.records[2]
    table = table_copy(snap)
    row = table[rec.req_pool_idx]
    row[12:16] = row[12:16][::-1].copy()  # same page, offsets reversed
    violation(corrupt(snap, table=table), "in-page offset")


def test_a_logical_page_split_over_two_physical_pages(state):
    _, snap = state
    rec = snap.records[2]
    table = table_copy(snap)
    free_page = int(snap.free_pages[0])
    table[rec.req_pool_idx, 13] = free_page * PS + 1
    violation(corrupt(snap, table=table), "spans physical pages")


def test_a_protected_prefix_without_a_lock(state):
    _, snap = state
    violation(corrupt(snap, lock_nodes={}), "locks no tree node")


def test_a_protected_prefix_on_pages_of_other_tokens(state):
    ledger, snap = state
    rec = snap.records[2]
    table = table_copy(snap)
    # Swap the first two cached pages in the row: still tree pages, but not this path's.
    row = table[rec.req_pool_idx]
    row[0:4], row[4:8] = row[4:8].copy(), row[0:4].copy()
    violation(corrupt(snap, table=table), "is not the slot path of its locked node")


def test_tree_sizes_that_disagree_with_the_locks(state):
    _, snap = state
    tree = snap.tree
    wrong = dataclasses.replace(
        tree, protected_size=tree.protected_size - PS, evictable_size=tree.evictable_size + PS
    )
    violation(corrupt(snap, tree=wrong), "disagree with the live locks")
    refs = list(tree.lock_refs)
    refs[0] += 1
    violation(
        corrupt(snap, tree=dataclasses.replace(tree, lock_refs=refs)), "live locks at or below it"
    )


def test_a_lock_on_a_node_that_is_gone(state):
    _, snap = state
    violation(corrupt(snap, lock_nodes={2: 12345}), "not in the tree")


def test_a_released_record_that_still_locks(state):
    _, snap = state
    with ledger_writes():
        released = ReqKvInfo()
    lock = snap.lock_nodes[2]
    violation(
        corrupt(
            snap, records={**snap.records, 3: released}, lock_nodes={**snap.lock_nodes, 3: lock}
        ),
        "holds no row but still locks",
    )


def test_idle_check_counts():
    assert (
        check_idle(free=10, tree_pages=6, total=16, records=0, held_rows=0, locked_tokens=0) == []
    )
    problems = check_idle(free=9, tree_pages=6, total=16, records=1, held_rows=1, locked_tokens=4)
    assert len(problems) == 4 and "free 9 + tree 6 + sessions 0 != total 16" in problems[-1]


def test_idle_check_counts_session_slots_once():
    idle = dict(free=6, tree_pages=6, total=16, records=0)
    # Two sessions hold 4 pages and 2 rows, and lock a shared tree prefix of 8 tokens.
    ok = check_idle(
        **idle,
        held_rows=2,
        locked_tokens=8,
        session_pages=4,
        session_rows=2,
        session_locked_tokens=16,
    )
    assert ok == []
    # A row no session holds, locks no session explains, a turn still open.
    bad = check_idle(
        **idle,
        held_rows=3,
        locked_tokens=24,
        session_pages=4,
        session_rows=2,
        session_locked_tokens=16,
        turns=1,
    )
    assert len(bad) == 3
    assert "turns" in bad[0] and "3 rows held, 2 by sessions" in bad[1] and "24" in bad[2]
    # Sessions' pages counted as free or tree too: conservation breaks.
    assert (
        check_idle(
            free=10,
            tree_pages=6,
            total=16,
            records=0,
            held_rows=0,
            locked_tokens=0,
            session_pages=4,
        )
        != []
    )


def test_a_lock_held_by_no_record_or_session(state):
    ledger, snap = state
    lock = snap.lock_nodes[2]
    violation(corrupt(snap, lock_nodes={**snap.lock_nodes, 99: lock}), "request 99, which holds")
    violation(corrupt(snap, session_lock_nodes={"ghost": lock}), "session 'ghost', which holds")
    # The idle check sees them too.
    run_sync(ledger.finish(2, np.arange(100, 118)))
    ledger.forget(2)
    assert run_sync(ledger.idle_problems()) == []
    ledger.lock_nodes[99] = snap.tree.ids[0]
    ledger.session_lock_nodes["ghost"] = snap.tree.ids[0]
    problems = run_sync(ledger.idle_problems())
    assert any("tree locks of requests" in p for p in problems), problems
    assert any("sessions holding no KV" in p for p in problems), problems


def test_the_window_over_the_tree_prefix_and_the_tree_page_states():
    from kvcore import SwaPages

    ledger, tree = make_ledger(32, PS, 4, capacity=64)
    ledger.swa, ledger.window, ledger.swa_free_step = SwaPages(32, 32, PS), 8, PS
    first = np.arange(100, 124)
    run_sync(ledger.alloc_extend(1, first, 64, []))
    run_sync(ledger.finish(1, first))
    ledger.forget(1)
    run_sync(ledger.alloc_extend(2, np.concatenate([first, [1, 2]]), 64, []))
    snap = run_sync(ledger.snapshot())
    check_invariants(snap)
    # Kill the sliding page of the tree page the next query's window reads (position 20):
    # the tree prefix is read too, and the tree's own page state disagrees.
    rec = snap.records[2]
    page = int(snap.table[rec.req_pool_idx, 20]) // PS
    smap = snap.swa_map.copy()
    freed = smap[page]
    smap[page] = 0
    free = np.concatenate([snap.swa_free_pages, [freed]])
    violation(corrupt(snap, swa_map=smap, swa_free_pages=free), "is marked alive")
    alive = [np.asarray(v[::PS]) // PS != page for v in snap.tree.values]
    tree_snap = dataclasses.replace(
        snap.tree, alive=[a & b for a, b in zip(snap.tree.alive, alive)]
    )
    violation(
        corrupt(snap, swa_map=smap, swa_free_pages=free, tree=tree_snap),
        "lies in the window its next query reads",
    )
