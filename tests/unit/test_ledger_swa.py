"""Sliding-window KV in the ledger: two pools, window freeing, the prefix tree past the window.

Page size 4, window 16, freed in steps of 4 tokens; the invariant checker (both pools)
runs after every operation.
"""

from __future__ import annotations

import numpy as np

from actors.allocator.ledger import SwaMapDelta
from kvcore import SwaPages, check_invariants
from tests.unit.ledger_driver import make_ledger, run_sync

PS, WINDOW = 4, 16


class Driver:
    def __init__(self, num_pages=64, swa_pages=64, rows=8, capacity=256, free_prompt=True):
        self.ledger, self.tree = make_ledger(num_pages, PS, rows, capacity)
        self.ledger.swa = SwaPages(num_pages, swa_pages, PS)
        self.ledger.window = WINDOW
        self.ledger.swa_free_step = PS
        self.ledger.swa_free_prompt = free_prompt
        self.maps: list[SwaMapDelta] = []

    def check(self):
        check_invariants(run_sync(self.ledger.snapshot()))

    def extend(self, rid, tokens, budget=10_000, session=""):
        deltas = []
        g = run_sync(self.ledger.alloc_extend(rid, tokens, budget, deltas, session=session))
        self.maps += [d for d in deltas if isinstance(d, SwaMapDelta)]
        self.check()
        return g

    def decode(self, rid, steps=1):
        for _ in range(steps):
            deltas = []
            assert run_sync(self.ledger.alloc_decode([rid], deltas)) == 0
            self.maps += [d for d in deltas if isinstance(d, SwaMapDelta)]
            self.check()

    def finish(self, rid, tokens):
        run_sync(self.ledger.finish(rid, tokens))
        self.ledger.forget(rid)
        self.check()

    def sliding_pages_of(self, rid) -> int:
        rec = self.ledger.records[rid]
        row = self.ledger.table.table[rec.req_pool_idx, : rec.kv_allocated_len : PS] // PS
        return int(self.ledger.swa.mapped(row).sum())


def toks(seed, n):
    return np.random.default_rng(seed).integers(10, 5000, n).astype(np.int64)


def test_decode_frees_sliding_pages_the_window_passed_and_keeps_full_ones():
    d = Driver()
    d.extend(1, toks(1, 10))
    d.decode(1, 50)  # 60 positions
    rec = d.ledger.records[1]
    # The next query (position 60) reads keys 45..60: pages from 44 on keep sliding KV.
    assert rec.swa_evicted_seqlen == 44
    assert d.sliding_pages_of(1) == 4  # positions 44..59
    full_pages = rec.kv_allocated_len // PS
    assert d.ledger.pool.num_free == 64 - full_pages  # full layers keep everything
    assert d.ledger.swa.num_free == 64 - 4
    assert d.ledger.counters.swa_freed_pages == 11
    # Every new full page got a sliding page, announced to the runner.
    announced = np.concatenate([m.full_pages for m in d.maps])
    assert sorted(announced.tolist()) == sorted(set(announced.tolist()))
    assert len(announced) == full_pages


def test_a_prefix_hit_is_cut_where_the_window_before_it_lost_its_sliding_kv():
    d = Driver()
    system = toks(9, 24)
    d.extend(1, system)
    d.finish(1, system)  # 6 pages in the tree, sliding KV intact
    own = toks(2, 60)
    d.extend(2, np.concatenate([system, own[:8]]))  # 24 cached, protected
    d.decode(2, 48)  # 80 positions: sliding KV of 24..63 freed (pages 6..15)
    assert d.ledger.records[2].swa_evicted_seqlen == 64
    hist = np.concatenate([system, own[:56]])
    d.finish(2, hist)  # 80 tokens in the tree, pages 6..15 without sliding KV
    # The whole path: the window before position 80 (65..79) is all there.
    g = d.extend(3, np.concatenate([hist, toks(3, 4)]))
    assert g.cached_len == 80
    run_sync(d.ledger.abort(3))
    d.ledger.forget(3)
    # A prompt matching 40 tokens: the window before 40 lost its sliding KV, and so did
    # every one down to 24, where the system prompt's pages still have theirs.
    g = d.extend(4, np.concatenate([hist[:42], toks(4, 6)]))
    assert g.cached_len == 24
    d.check()


def test_the_sliding_pool_binds_admission_and_a_refusal_changes_nothing():
    d = Driver(num_pages=64, swa_pages=12)
    assert d.extend(1, toks(1, 40)) is not None  # 10 sliding pages
    before = (d.ledger.pool.num_free, d.ledger.swa.num_free)
    assert d.extend(2, toks(2, 12)) is None  # 3 full pages free plenty, 2 sliding: refused
    assert (d.ledger.pool.num_free, d.ledger.swa.num_free) == before
    d.decode(1, 30)  # the window frees sliding pages of request 1
    assert d.ledger.swa.num_free > before[1]
    assert d.extend(2, toks(2, 8)) is not None


def test_release_frees_both_pools_and_eviction_returns_what_is_left():
    d = Driver()
    prompt = toks(1, 10)
    d.extend(1, prompt)
    d.decode(1, 50)
    d.finish(1, np.concatenate([prompt, toks(2, 51)]))
    assert run_sync(d.ledger.idle_problems()) == []
    tree_pages = d.tree.evictable_size // PS
    assert d.ledger.pool.num_free == 64 - tree_pages
    assert d.ledger.swa.num_free == 64 - 4  # only the window's pages are still in the tree
    run_sync(d.ledger.drop_cache())
    d.check()
    assert d.ledger.pool.num_free == 64 and d.ledger.swa.num_free == 64


def test_a_session_restores_only_while_its_window_is_whole():
    d = Driver()
    d.ledger.open_slot("s")
    prompt = toks(1, 10)
    d.extend(1, prompt, session="s")
    d.decode(1, 50)
    hist = np.concatenate([prompt, toks(2, 51)])
    d.finish(1, hist)
    slot = d.ledger.slots["s"]
    assert slot.rec.swa_evicted_seqlen == 44
    g = d.extend(2, np.concatenate([hist, toks(3, 3)]), session="s")
    assert g.cached_len == 60  # window 45..59 is all there
    run_sync(d.ledger.abort(2))
    d.ledger.forget(2)
    d.ledger.open_slot("t")
    d.extend(3, prompt, session="t")
    d.decode(3, 50)
    d.finish(3, hist)
    # Diverging at 30 (< the evicted 44): the slot cannot serve it and goes to the tree.
    g = d.extend(4, np.concatenate([hist[:30], toks(4, 5)]), session="t")
    assert g.cached_len == 0 and d.ledger.slots["t"].rec is None


def test_by_default_prompts_keep_their_sliding_kv_and_every_prefix_stays_reusable():
    d = Driver(free_prompt=False)
    prompt = toks(1, 40)
    d.extend(1, prompt, budget=16)  # chunked: the prompt's chunks go to the tree as usual
    run_sync(d.ledger.cache_unfinished(1, prompt, []))
    d.extend(1, prompt, budget=16)
    run_sync(d.ledger.cache_unfinished(1, prompt, []))
    d.extend(1, prompt, budget=16)
    d.decode(1, 40)  # 80 positions
    rec = d.ledger.records[1]
    assert rec.swa_evict_floor == 40
    # Only output positions the window passed lost their sliding KV: 40 .. 63.
    assert rec.swa_evicted_seqlen == 64 and d.ledger.counters.swa_freed_pages == 6
    hist = np.concatenate([prompt, toks(2, 40)])
    d.finish(1, hist)
    # Any prefix of the prompt is a full hit (its windows are intact).
    g = d.extend(2, np.concatenate([prompt[:30], toks(3, 5)]))
    assert g.cached_len == 28
