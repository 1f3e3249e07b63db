"""Session slots in the ledger: save, restore, trim, pin, abort, retract, close.

Every test runs the exact invariant checker after every ledger operation, and `FakeKv`
checks that a restored row still maps each position to the KV written for its token.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcore import check_invariants
from tests.unit.ledger_driver import FakeKv, make_ledger, run_sync

PS = 4


class Driver:
    """A ledger with sessions, checked after every operation."""

    def __init__(
        self, num_pages: int = 64, rows: int = 8, capacity: int = 256, radix=True, cls=None
    ):
        extra = {"cls": cls} if cls is not None else {}
        self.ledger, self.tree = make_ledger(num_pages, PS, rows, capacity, radix=radix, **extra)
        self.kv = FakeKv((num_pages + 1) * PS)
        self.capacity = capacity

    def check(self) -> None:
        check_invariants(run_sync(self.ledger.snapshot()))

    def extend(self, rid, tokens, budget=10_000, session="", match_prefix=True):
        deltas = []
        g = run_sync(
            self.ledger.alloc_extend(
                rid, tokens, budget, deltas, match_prefix=match_prefix, session=session
            )
        )
        self.check()
        if g is not None:
            self.kv.apply(deltas, self.capacity)
            self.kv.write(g.row, tokens, g.start, g.end)
        return g

    def decode(self, rid, tokens):
        """One decode step: the KV of the last known token, whose slot is granted now."""
        deltas = []
        assert run_sync(self.ledger.alloc_decode([rid], deltas)) == 0
        self.check()
        self.kv.apply(deltas, self.capacity)
        rec = self.ledger.records[rid]
        self.kv.write(rec.req_pool_idx, tokens, rec.kv_committed_len - 1, rec.kv_committed_len)

    def turn(self, rid, prompt, new_tokens, session):
        """A whole turn: prefill, then decode `new_tokens` tokens (the last one sampled
        but never fed back, as in the engine), finish. Returns (grant, all tokens)."""
        g = self.extend(rid, prompt, session=session)
        assert g is not None
        tokens = np.concatenate([prompt, new_tokens]).astype(np.int64)
        for i in range(len(new_tokens) - 1):
            self.decode(rid, tokens[: len(prompt) + i + 1])
        self.finish(rid, tokens)
        return g, tokens

    def finish(self, rid, tokens):
        run_sync(self.ledger.finish(rid, tokens))
        self.ledger.forget(rid)
        self.check()

    def abort(self, rid):
        run_sync(self.ledger.abort(rid))
        self.ledger.forget(rid)
        self.check()

    def close(self, *sids):
        pages = run_sync(self.ledger.close_slots(list(sids)))
        self.check()
        return pages

    def idle(self):
        return run_sync(self.ledger.idle_problems())

    def tree_port(self):
        return self.ledger.tree


def toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 5000, n).astype(np.int64)


def test_a_turn_saves_its_record_and_the_next_turn_computes_only_new_tokens():
    d = Driver()
    d.ledger.open_slot("s")
    prompt1 = toks(1, 30)
    g1, hist = d.turn(1, prompt1, toks(2, 6), "s")
    assert g1.cached_len == 0
    slot = d.ledger.slots["s"]
    # The slot holds the whole turn but its last token (sampled, never computed).
    assert slot.rec.kv_committed_len == len(hist) - 1 == 35
    assert d.ledger.session_pages() == 9  # ceil(35 / 4): the partial last page is kept
    assert d.idle() == []  # a session may hold KV at idle
    prompt2 = np.concatenate([hist, toks(3, 7)])
    g2 = d.extend(2, prompt2, session="s")
    assert (g2.cached_len, g2.start, g2.end) == (35, 35, len(prompt2))
    assert g2.row == g1.row  # the same row: restored, not copied
    assert d.ledger.slots["s"].rec is None  # the pages are the request's while it runs
    d.kv.assert_row_holds(g2.row, prompt2, len(prompt2))
    assert d.ledger.counters.session_hit_tokens == 35


def test_a_divergent_prompt_frees_the_tail_page_aligned_and_recomputes_it():
    d = Driver()
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 40), toks(2, 4), "s")  # slot: 43 tokens, 11 pages
    free_before = d.ledger.pool.num_free
    # The client re-rendered the history: only the first 22 tokens match.
    prompt2 = np.concatenate([hist[:22], toks(9, 10)])
    g = d.extend(2, prompt2, session="s")
    assert (g.cached_len, g.start) == (22, 22)
    # Kept: pages of [0, 24) (6 pages; the partial one is overwritten from 22); freed: 5;
    # the new 10 tokens fill 2 in the open page and need 2 more pages.
    assert d.ledger.pool.num_free == free_before + 5 - 2
    d.kv.assert_row_holds(g.row, prompt2, len(prompt2))


def test_session_kv_survives_traffic_the_free_pages_and_tree_can_serve():
    d = Driver(num_pages=24)
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 3), "s")  # 32 tokens: 8 pages pinned
    for rid in range(10, 20):  # other traffic cycles the rest of the pool
        g = d.extend(rid, toks(rid, 50))
        assert g is not None
        d.finish(rid, toks(rid, 50))
    assert d.ledger.session_pages() == 8 and d.ledger.slots["s"].rec.kv_committed_len == 32
    g = d.extend(2, np.concatenate([hist, toks(3, 5)]), session="s")
    assert g.cached_len == 32


def test_a_request_never_waits_behind_an_idle_session():
    """Pressure the free list and the tree cannot cover releases the least recently used
    idle session to the prefix tree; the session stays open and its next turn finds in the
    tree what survived."""
    d = Driver(num_pages=24)
    d.ledger.open_slot("old")
    d.ledger.open_slot("new")
    _, old = d.turn(1, toks(1, 30), toks(2, 3), "old")  # 8 pages
    _, new = d.turn(2, toks(4, 30), toks(5, 3), "new")  # 8 pages, used later
    g = d.extend(99, toks(99, 30))  # needs 8 pages: only 8 are free
    assert g is not None and d.ledger.counters.session_reclaims == 0
    d.finish(99, toks(99, 30))
    g = d.extend(98, toks(98, 62))  # needs 16: the tree has 7, "old" must go
    assert g is not None
    assert d.ledger.counters.session_reclaims == 1
    assert d.ledger.slots["old"].rec is None and d.ledger.slots["new"].rec is not None
    d.finish(98, toks(98, 62))
    assert d.idle() == []
    # "new" still restores; "old" prefills from whatever the tree kept.
    g = d.extend(3, np.concatenate([new, toks(6, 5)]), session="new")
    assert g.cached_len == 32
    d.finish(3, np.concatenate([new, toks(6, 5)]))
    g = d.extend(4, np.concatenate([old, toks(7, 5)]), session="old")
    assert g is not None and g.cached_len % PS == 0 and g.cached_len <= 32
    d.finish(4, np.concatenate([old, toks(7, 5)]))
    assert d.idle() == []


def _cached_then_session_turn(d, rid, sid, seed):
    """A plain request caches a 24-token prefix (6 pages), then session `sid`'s turn
    starts from it: the idle slot then locks those 6 tree pages and owns 2 of its own."""
    prefix = toks(seed, 24)
    d.extend(rid, prefix)
    d.finish(rid, prefix)
    d.ledger.open_slot(sid)
    d.turn(rid + 1, np.concatenate([prefix, toks(seed + 1, 6)]), toks(seed + 2, 2), sid)
    rec = d.ledger.slots[sid].rec
    assert rec.cache_protected_len == 24 and d.ledger._own_pages(rec) == 2


def test_pressure_counts_the_tree_pages_only_idle_sessions_lock():
    """An idle slot's KV may lie mostly in the prefix tree, locked by the slot (a prefix
    it matched, or the chunks its prefill cached). Releasing the slot makes those pages
    evictable, so a request that fits once idle sessions are reclaimed is granted (it was
    refused: only the slots' own pages were counted, and the engine cut it short)."""
    d = Driver(num_pages=24)
    _cached_then_session_turn(d, 1, "a", 10)
    _cached_then_session_turn(d, 3, "b", 20)
    pool = d.ledger.pool
    assert pool.num_free == 8 and d.ledger.session_pages() == 4
    assert run_sync(d.tree_port().evictable_pages()) == 0  # all 12 tree pages locked
    g = d.extend(99, toks(99, 62))  # 16 pages: 8 free + 4 own + 12 unlocked by release
    assert g is not None and (g.start, g.end) == (0, 62)
    assert d.ledger.counters.session_reclaims >= 1
    d.finish(99, toks(99, 62))
    assert d.idle() == []


def test_the_sessions_cap_counts_the_tree_pages_only_idle_sessions_lock():
    d = Driver(num_pages=64)
    d.ledger.session_max_pages = 12
    _cached_then_session_turn(d, 1, "a", 10)  # pins 2 own + 6 locked tree pages
    assert run_sync(d.ledger.pinned_pages()) == 8 and d.ledger.counters.session_reclaims == 0
    _cached_then_session_turn(d, 3, "b", 20)  # 16 > 12: the least recently used goes
    assert d.ledger.slots["a"].rec is None and d.ledger.slots["b"].rec is not None
    assert run_sync(d.ledger.pinned_pages()) == 8
    assert d.ledger.counters.session_reclaims == 1
    assert d.idle() == []


def test_pressure_still_refuses_what_even_every_idle_session_cannot_make_room_for():
    d = Driver(num_pages=24)
    _cached_then_session_turn(d, 1, "a", 10)
    hog = d.extend(50, toks(50, 24))  # 6 pages held by a running request
    assert hog is not None
    before = (d.ledger.pool.num_free, d.ledger.slots["a"].rec)
    # free 10 + own 2 + unlockable 6 = 18 < 20: refused, nothing changed
    assert d.extend(99, toks(99, 80)) is None
    assert (d.ledger.pool.num_free, d.ledger.slots["a"].rec) == before
    assert d.ledger.counters.session_reclaims == 0
    d.abort(50)
    assert d.idle() == []


def test_sessions_pin_at_most_their_cap():
    d = Driver(num_pages=64)
    d.ledger.session_max_pages = 12
    for i, sid in enumerate("abc"):
        d.ledger.open_slot(sid)
        d.turn(10 + i, toks(i, 20), toks(100 + i, 2), sid)  # 21 committed: 6 pages each
    # a (least recently used) was released when c's save took the slots to 18 pages.
    assert d.ledger.session_pages() <= 12
    assert d.ledger.slots["a"].rec is None
    assert d.ledger.slots["b"].rec is not None and d.ledger.slots["c"].rec is not None
    assert d.ledger.counters.session_reclaims == 1
    assert d.idle() == []


def test_a_refused_turn_leaves_the_slot_as_it_was_and_restores_on_retry():
    d = Driver(num_pages=16)
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 20), toks(2, 5), "s")  # 24 tokens, 6 pages
    hog = d.extend(50, toks(50, 40))  # 10 pages held by a running request
    assert hog is not None
    prompt2 = np.concatenate([hist, toks(3, 20)])  # needs 6 more pages; none is free
    before = d.ledger.slots["s"].rec
    assert d.extend(2, prompt2, session="s") is None
    slot = d.ledger.slots["s"]
    assert slot.rec is before and slot.rec.kv_committed_len == 24 and slot.turn is None
    d.abort(50)
    g = d.extend(2, prompt2, session="s")  # the retry restores as if nothing happened
    assert g.cached_len == 24
    d.kv.assert_row_holds(g.row, prompt2, len(prompt2))


def test_abort_mid_turn_wipes_the_session_kv_and_leaks_nothing():
    d = Driver()
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 4), "s")
    prompt2 = np.concatenate([hist, toks(3, 8)])
    d.extend(2, prompt2, session="s")
    d.abort(2)
    slot = d.ledger.slots["s"]
    assert slot.rec is None and slot.turn is None and d.ledger.turn_session == {}
    assert d.ledger.session_pages() == 0 and d.idle() == []
    # The next turn prefills from scratch (the session's KV was never in the tree).
    g = d.extend(3, prompt2, session="s")
    assert g.cached_len == 0 and g.end == len(prompt2)


def test_a_retracted_turn_goes_through_the_tree_and_is_saved_at_its_finish():
    d = Driver()
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 4), "s")
    prompt2 = np.concatenate([hist, toks(3, 9)])
    d.extend(2, prompt2, session="s")
    run_sync(d.ledger.retract(2, prompt2))
    d.check()
    assert d.ledger.slots["s"].rec is None  # the KV went to the prefix tree, page-aligned
    g = d.extend(2, prompt2, session="s")
    assert g.cached_len == 40  # floor_page(42): matched in the tree
    tokens = np.concatenate([prompt2, toks(4, 1)])
    d.finish(2, tokens)
    assert d.ledger.slots["s"].rec.kv_committed_len == len(prompt2)


def test_first_turn_tree_prefix_stays_locked_by_the_session_across_turns():
    d = Driver()
    system = toks(7, 24)
    d.extend(1, system)
    d.finish(1, system)  # a plain request caches it
    d.ledger.open_slot("s")
    g1, hist = d.turn(2, np.concatenate([system, toks(1, 10)]), toks(2, 3), "s")
    assert g1.cached_len == 24
    assert d.ledger.slots["s"].rec.cache_protected_len == 24
    assert "s" in d.ledger.session_lock_nodes  # the checker pins the lock to the slot
    assert d.idle() == []
    g2 = d.extend(3, np.concatenate([hist, toks(3, 4)]), session="s")
    assert g2.cached_len == len(hist) - 1
    assert 3 in d.ledger.lock_nodes and "s" not in d.ledger.session_lock_nodes


def test_divergence_inside_the_protected_prefix_releases_the_slot_to_the_tree():
    d = Driver()
    system = toks(7, 24)
    d.extend(1, system)
    d.finish(1, system)
    d.ledger.open_slot("s")
    _, hist = d.turn(2, np.concatenate([system, toks(1, 10)]), toks(2, 3), "s")
    other = np.concatenate([system[:8], toks(5, 20)])  # diverges at 8 < protected 24
    g = d.extend(3, other, session="s")
    assert g.cached_len == 8  # from the tree, which now also holds the slot's pages
    assert d.ledger.slots["s"].rec is None


def test_close_releases_whole_pages_to_the_tree_and_the_rest_to_the_pool():
    d = Driver()
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 4), "s")  # 33 tokens: 8 whole pages + 1
    total = d.ledger.pool.num_pages
    assert d.close("s") == 9
    assert "s" not in d.ledger.slots
    assert d.tree.evictable_size == 32 and d.ledger.pool.num_free == total - 8
    assert d.idle() == []
    g = d.extend(2, np.concatenate([hist, toks(3, 3)]))  # a plain request hits the tree
    assert g.cached_len == 32


def test_close_during_a_turn_takes_effect_when_the_turn_ends():
    d = Driver()
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 4), "s")
    prompt2 = np.concatenate([hist, toks(3, 5)])
    d.extend(2, prompt2, session="s")
    assert d.close("s") == 0
    assert d.ledger.slots["s"].close_pending
    d.finish(2, np.concatenate([prompt2, toks(4, 1)]))
    assert "s" not in d.ledger.slots and d.ledger.session_pages() == 0
    assert d.idle() == []


@pytest.mark.parametrize("radix", [True, False])
def test_drop_cache_empties_every_slot_but_keeps_the_sessions(radix):
    d = Driver(radix=radix)
    d.ledger.open_slot("s")
    d.turn(1, toks(1, 30), toks(2, 4), "s")
    run_sync(d.ledger.drop_cache())
    d.check()
    assert "s" in d.ledger.slots and d.ledger.slots["s"].rec is None
    assert d.ledger.pool.num_free == d.ledger.pool.num_pages


def test_the_idle_check_sees_a_leak_next_to_sessions():
    d = Driver()
    d.ledger.open_slot("s")
    d.turn(1, toks(1, 30), toks(2, 4), "s")
    assert d.idle() == []
    d.extend(5, toks(5, 9))  # a request still holding KV at "idle"
    problems = d.idle()
    assert any("request records" in p for p in problems)
    assert any("rows held" in p for p in problems)
