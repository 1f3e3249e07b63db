"""Clients' hints on sessions in the ledger: prefetch (a tier's KV back into the pool before
the next turn), priority (who leaves the pool and the tiers first) and retain_s (kept in the
tiers unless nothing else is left to drop). Every operation runs the exact checker."""

from __future__ import annotations

import time

import numpy as np

from tests.unit.ledger_driver import run_sync
from tests.unit.test_ledger_tiers import (
    Driver,
    demoted_on_a_tree_prefix,
    demoted_session,
    toks,
    with_ledger_writes,
)


def test_a_prefetch_brings_the_kv_back_and_the_next_turn_restores_it_from_the_pool():
    d = Driver()
    hist = demoted_session(d)  # 35 positions in the host tier, none in the tree
    assert run_sync(d.ledger.prefetch_slot("s")) == 0  # past the sessions' cap (0 pages)
    d.ledger.session_max_pages = None
    assert run_sync(d.ledger.prefetch_slot("s")) == 35
    d.check()
    slot = d.ledger.slots["s"]
    assert slot.stored is None and slot.rec.kv_committed_len == 35
    assert d.ledger.host.entries == {} and d.port.entries == {}
    assert d.ledger.counters.session_promotes == 1
    loads = len(d.port.loads)
    prompt = np.concatenate([hist, toks(3, 7)])
    g = d.extend(2, prompt, session="s")  # restored from the slot: nothing is loaded
    assert (g.cached_len, g.start) == (35, 35) and len(d.port.loads) == loads
    assert d.ledger.counters.session_hit_tokens == 35
    # The prefetch's row reached the runner with this admission's deltas, before its own.
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_a_prefetch_shares_what_the_tree_still_holds():
    d = Driver()
    hist = demoted_on_a_tree_prefix(d)  # the tree has its first 8 pages
    d.ledger.session_max_pages = None
    assert run_sync(d.ledger.prefetch_slot("s")) == 35
    d.check()
    assert d.ledger.slots["s"].rec.cache_protected_len == 32
    assert d.port.loads[-1][1:] == (32, 3)
    g = d.extend(2, np.concatenate([hist, toks(3, 7)]), session="s")
    d.kv.assert_row_holds(g.row, np.concatenate([hist, toks(3, 7)]), 42)


def test_a_prefetch_counts_the_tree_prefix_its_slot_will_lock_against_the_cap():
    """After the prefetch the idle slot locks its matched tree prefix (8 pages) and owns
    the loaded page: 9 pinned, past a cap of 5, so the hint is refused (it was granted:
    the check counted the loaded page alone, and the next finish had to release a session)."""
    d = Driver()
    demoted_on_a_tree_prefix(d)  # the tree has its first 8 pages
    d.ledger.session_max_pages = 5
    assert run_sync(d.ledger.prefetch_slot("s")) == 0
    d.check()
    assert d.ledger.slots["s"].stored is not None and d.ledger.slots["s"].rec is None
    d.ledger.session_max_pages = 9
    assert run_sync(d.ledger.prefetch_slot("s")) == 35
    d.check()
    assert run_sync(d.ledger.pinned_pages()) == 9


def test_a_prefetched_window_session_keeps_its_freed_range():
    d = Driver(swa=True)
    d.ledger.session_max_pages = 0
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 10), toks(2, 51), "s")  # 60 positions, the last window kept
    d.ledger.session_max_pages = None
    d.evict_tree()
    assert run_sync(d.ledger.prefetch_slot("s")) == 60
    d.check()
    rec = d.ledger.slots["s"].rec
    assert (rec.swa_evict_floor, rec.swa_evicted_seqlen) == (0, 44)
    prompt = np.concatenate([hist, toks(3, 9)])
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 60
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    d.assert_window_holds(g.row, prompt, 60)


def test_a_prefetch_never_takes_the_pool_from_others_and_changes_nothing_when_refused():
    d = Driver(num_pages=24)
    hist = demoted_session(d)
    d.evict_tree()
    d.ledger.session_max_pages = None
    d.ledger.open_slot("t")
    d.turn(5, toks(5, 40), toks(6, 2), "t")  # an idle session pins 11 pages
    hog = d.extend(50, toks(50, 40))  # a running request holds 10 more: 3 are free
    assert hog is not None
    before = (d.ledger.pool.num_free, d.ledger.slots["s"].stored, d.ledger.slots["t"].rec)
    assert run_sync(d.ledger.prefetch_slot("s")) == 0
    d.check()
    assert (d.ledger.pool.num_free, d.ledger.slots["s"].stored, d.ledger.slots["t"].rec) == before
    assert run_sync(d.ledger.prefetch_slot("nobody")) == 0
    d.abort(50)
    assert run_sync(d.ledger.prefetch_slot("s")) == 35
    d.check()
    g = d.extend(2, np.concatenate([hist, toks(3, 2)]), session="s")
    d.kv.assert_row_holds(g.row, np.concatenate([hist, toks(3, 2)]), 37)


def test_pressure_takes_the_lowest_priority_idle_session_first():
    d = Driver(num_pages=24)
    d.ledger.open_slot("important", priority=5)
    d.ledger.open_slot("casual")
    d.turn(1, toks(1, 30), toks(2, 3), "important")  # the least recently used
    d.turn(3, toks(3, 30), toks(4, 3), "casual")
    g = d.extend(98, toks(98, 40))  # needs 10 pages, 8 are free: one session must go
    assert g is not None
    assert d.ledger.slots["casual"].stored is not None and d.ledger.slots["casual"].rec is None
    assert d.ledger.slots["important"].rec is not None


def test_a_retained_session_stays_in_the_tiers_while_others_are_dropped():
    d = Driver(budget=8 * 40)  # one 35-position entry fits
    d.ledger.session_max_pages = 0  # every finished turn is demoted at once
    d.ledger.open_slot("a", retain_s=3600)
    for rid, sid in ((1, "a"), (2, "b")):
        d.ledger.open_slot(sid)
        d.turn(rid, toks(rid, 30), toks(rid + 10, 6), sid)
    # "a" is the least recently used, but retained: "b" is dropped instead.
    assert d.ledger.slots["a"].stored is not None and d.ledger.slots["b"].stored is None
    with_ledger_writes(lambda: setattr(d.ledger.slots["a"], "retain_until", time.monotonic()))
    d.ledger.open_slot("c")
    d.turn(3, toks(3, 30), toks(13, 6), "c")  # its retention is over: LRU again
    assert d.ledger.slots["a"].stored is None and d.ledger.slots["c"].stored is not None
    d.check()


def test_a_prefetchs_deltas_survive_an_operation_that_fails_and_go_with_the_next():
    d = Driver()
    hist = demoted_session(d)
    d.ledger.session_max_pages = None
    assert run_sync(d.ledger.prefetch_slot("s")) == 35
    pending = list(d.ledger._pending)
    assert pending

    async def broken(tokens):
        raise RuntimeError("the radix actor timed out")

    real, d.ledger.tree.match_and_lock = d.ledger.tree.match_and_lock, broken
    try:
        run_sync(d.ledger.alloc_extend(9, toks(9, 20), 100, [], match_prefix=True))
    except RuntimeError:
        pass
    d.ledger.tree.match_and_lock = real
    assert d.ledger._pending == pending  # not lost with the failed operation's deltas
    prompt = np.concatenate([hist, toks(3, 2)])
    g = d.extend(2, prompt, session="s")
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
