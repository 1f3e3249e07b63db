"""Unit tests of kvcore's pieces: page pool, req-to-token table, radix tree, checker."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore import (
    InvariantViolation,
    KvSnapshot,
    PageDoubleFree,
    PageNotOwned,
    PagePool,
    RadixTree,
    ReqKvInfo,
    ReqToTokenTable,
    RowError,
    check_invariants,
    pages_of_slots,
    slots_of_pages,
)
from kvcore.req_kv_info import RecordWriteOutsideLedger, ledger_writes


def test_req_kv_info_lifecycle():
    with ledger_writes():
        rec = ReqKvInfo()
        assert not rec.is_held and rec.is_released
        rec.req_pool_idx, rec.kv_allocated_len, rec.kv_committed_len = 3, 10, 10
        assert rec.is_held and not rec.is_released
        rec.req_pool_idx = None
        rec.mark_released()
    assert rec.is_released and rec.kv_committed_len == 0 and rec.cache_protected_len == 0


def test_a_record_is_written_only_inside_the_ledgers_context():
    """The write guard cannot be bypassed by spelling: every way to write a field, build or
    re-initialise a record outside `ledger_writes()` raises and changes nothing."""
    import copy
    import pickle

    with ledger_writes():
        rec = ReqKvInfo(req_pool_idx=2, kv_committed_len=5, kv_allocated_len=5)
    attempts = {
        "attribute": lambda: setattr(rec, "kv_allocated_len", 9),
        "descriptor": lambda: ReqKvInfo.kv_allocated_len.__set__(rec, 9),
        "object.__setattr__": lambda: object.__setattr__(rec, "kv_committed_len", 9),
        "__init__": lambda: rec.__init__(),
        "mark_released": lambda: getattr(rec, "mark_released")(),
        "constructor": lambda: ReqKvInfo(),
        "exec": lambda: exec("r.req_pool_idx = None", {"r": rec}),
        "copy": lambda: copy.copy(rec),
        "deepcopy": lambda: copy.deepcopy(rec),
        "pickle": lambda: pickle.dumps(rec),
    }
    for how, attempt in attempts.items():
        with pytest.raises(RecordWriteOutsideLedger):
            attempt()
            pytest.fail(f"{how} wrote a record outside the ledger")
    assert (rec.req_pool_idx, rec.kv_committed_len, rec.kv_allocated_len) == (2, 5, 5)
    with pytest.raises(AttributeError):
        rec._kv_allocated_len  # the storage has no name on the class


def test_page_pool_alloc_free_and_errors():
    pool = PagePool(num_pages=8, page_size=4)
    a = pool.alloc(3)
    assert a.tolist() == [1, 2, 3] and pool.num_free == 5
    assert pool.alloc(6) is None and pool.num_free == 5  # all or nothing
    pool.free(a[:1])
    with pytest.raises(PageDoubleFree, match=r"\[1\]"):
        pool.free([1])
    with pytest.raises(PageNotOwned, match=r"\[0\]"):
        pool.free([0])  # the padding page is never handed out
    with pytest.raises(PageNotOwned):
        pool.free([9])
    with pytest.raises(PageDoubleFree, match="twice"):
        pool.free([2, 2])
    assert pool.num_free == 6  # failed frees changed nothing
    pool.free([2, 3])
    assert sorted(pool.free_pages().tolist()) == list(range(1, 9))


def test_slots_pages_roundtrip():
    pages = np.array([3, 1], dtype=np.int64)
    slots = slots_of_pages(pages, 4)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert pages_of_slots(slots, 4).tolist() == [3, 1]
    assert pages_of_slots(slots[:5], 4).tolist() == [3, 1]


def test_req_to_token_rows():
    t = ReqToTokenTable(num_rows=2, row_capacity=8)
    r1, r2 = t.alloc_row(), t.alloc_row()
    assert {r1, r2} == {1, 2} and t.alloc_row() is None
    t.write(r1, 2, np.array([7, 8]))
    assert t.read(r1, 0, 4).tolist() == [0, 0, 7, 8]
    with pytest.raises(RowError):
        t.write(r1, 7, np.array([1, 2]))
    t.free_row(r1)
    with pytest.raises(RowError):
        t.free_row(r1)
    with pytest.raises(RowError):
        t.read(r1, 0, 1)


def test_radix_match_insert_split_page_aligned():
    tree = RadixTree(page_size=2)
    res = tree.insert([1, 2, 3, 4, 5], np.array([10, 11, 12, 13, 14]))
    assert res.existing_len == 0 and tree.total_size == 4  # floored to 4 tokens
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.length == 2 and m.slots.tolist() == [10, 11]  # split at the page boundary
    assert tree.num_nodes == 2
    res2 = tree.insert([1, 2, 7, 7], np.array([20, 21, 22, 23]))
    assert res2.existing_len == 2 and res2.slots.tolist() == [10, 11, 22, 23]
    assert tree.match_prefix([1, 2, 3, 4]).slots.tolist() == [10, 11, 12, 13]
    assert tree.match_prefix([9, 9]).length == 0


def test_radix_lock_and_lru_eviction():
    tree = RadixTree(page_size=1)
    a = tree.insert([1, 2, 3], np.array([1, 2, 3]))
    b = tree.insert([1, 2, 4], np.array([1, 2, 4]))
    c = tree.insert([5, 6], np.array([5, 6]))
    tree.inc_lock_ref(a.node_id)
    assert tree.protected_size == 3 and tree.evictable_size == 3
    tree.match_prefix([1, 2, 4])  # refresh b: c becomes the LRU leaf
    freed = tree.evict(1)
    assert sorted(freed.tolist()) == [5, 6]
    freed = tree.evict(10)  # b's leaf only: a's path is locked
    assert freed.tolist() == [4]
    assert tree.match_prefix([1, 2, 3]).length == 3
    tree.dec_lock_ref(a.node_id)
    with pytest.raises(ValueError):
        tree.dec_lock_ref(a.node_id)
    assert sorted(tree.evict(10).tolist()) == [1, 2, 3]
    assert tree.total_size == 0 and b.node_id != c.node_id


def test_pages_freed_by_unlocking_counts_nodes_whose_every_lock_is_released():
    tree = RadixTree(page_size=2)
    a = tree.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))  # node [1 2 3 4]
    b = tree.insert([1, 2, 5, 6], np.array([10, 11, 20, 21]))  # splits: [1 2] -> [3 4], [5 6]
    shared = tree.match_prefix([1, 2]).node_id
    tree.inc_lock_ref(a.node_id)
    tree.inc_lock_ref(b.node_id)
    before = (tree.evictable_size, tree.protected_size, tree.lock_ref(shared))
    # Releasing a's lock frees its own leaf only: b still locks the shared [1 2].
    assert tree.pages_freed_by_unlocking([a.node_id]).tolist() == [6]
    # Both: the shared page too; a node listed twice counts two locks.
    assert sorted(tree.pages_freed_by_unlocking([a.node_id, b.node_id]).tolist()) == [5, 6, 10]
    tree.inc_lock_ref(a.node_id)
    assert tree.pages_freed_by_unlocking([a.node_id]).tolist() == []
    assert sorted(tree.pages_freed_by_unlocking([a.node_id, a.node_id]).tolist()) == [6]
    assert (tree.evictable_size, tree.protected_size) == before[:2]  # a query, no change
    assert tree.lock_ref(shared) == before[2] + 1
    assert tree.pages_freed_by_unlocking([]).tolist() == []


def test_evicted_blocks_carry_their_whole_path_key_leaves_first():
    tree = RadixTree(page_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], np.arange(10, 16))
    tree.insert([1, 2, 3, 4, 7, 8], np.arange(20, 26))  # splits at 4: [1..4], [5, 6], [7, 8]
    tree.match_prefix([1, 2, 3, 4, 7, 8])  # [5, 6] is the least recently used leaf
    blocks = tree.evict_blocks(10)
    assert [(b.start, b.key.tolist(), b.slots.tolist()) for b in blocks] == [
        (4, [1, 2, 3, 4, 5, 6], [14, 15]),
        (4, [1, 2, 3, 4, 7, 8], [24, 25]),
        (0, [1, 2, 3, 4], [10, 11, 12, 13]),
    ]
    assert all(b.alive.tolist() == [True] * (len(b.slots) // 2) for b in blocks)
    assert tree.total_size == 0 and tree.num_nodes == 0


def _snapshot(pool, table, tree, records):
    return KvSnapshot(
        page_size=pool.page_size,
        total_pages=pool.num_pages,
        free_pages=pool.free_pages(),
        tree=tree.snapshot(),
        table=table.table,
        held_rows=table.held_rows(),
        records=records,
    )


def test_checker_names_leaks_double_owners_and_bad_order():
    pool, table, tree = PagePool(4, 1), ReqToTokenTable(2, 8), RadixTree(1)
    pages = pool.alloc(2)
    row = table.alloc_row()
    table.write(row, 0, pages)
    with ledger_writes():  # planted records
        rec = ReqKvInfo(req_pool_idx=row, kv_committed_len=2, kv_allocated_len=2)
    check_invariants(_snapshot(pool, table, tree, {"a": rec}))
    leaked = pool.alloc(1)
    with pytest.raises(InvariantViolation, match=rf"leaked pages \[{leaked[0]}\]"):
        check_invariants(_snapshot(pool, table, tree, {"a": rec}))
    pool.free(leaked)
    tree.insert([1, 2], pages)  # now the tree and request "a" both own the pages
    with pytest.raises(InvariantViolation, match="owned by both"):
        check_invariants(_snapshot(pool, table, tree, {"a": rec}))
    tree.evict(2)
    with ledger_writes():  # planted records
        bad = ReqKvInfo(req_pool_idx=row, kv_committed_len=3, kv_allocated_len=2)
    with pytest.raises(InvariantViolation, match="request 'b'"):
        check_invariants(_snapshot(pool, table, tree, {"b": bad}))
    with ledger_writes():  # planted records
        zombie = ReqKvInfo(req_pool_idx=None, kv_committed_len=2, kv_allocated_len=2)
    with pytest.raises(InvariantViolation, match="is_held=False"):
        check_invariants(_snapshot(pool, table, tree, {"a": rec, "z": zombie}))
