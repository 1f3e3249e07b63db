"""Sliding-window KV in the ledger: two pools, window freeing, the prefix tree past the window.

Page size 4, window 16, freed in steps of 4 tokens; the invariant checker (both pools)
runs after every operation.
"""

from __future__ import annotations

import numpy as np
import pytest

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

    def runner_map(self) -> np.ndarray:
        """The runner's full -> sliding page map, rebuilt from the deltas in order."""
        out = np.zeros_like(self.ledger.swa.map)
        for m in self.maps:
            out[m.full_pages] = m.swa_pages
        return out

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
    # Every new full page got a sliding page, announced to the runner, and every freed
    # sliding page was announced as unmapped (page 0): the runner's map is the ledger's.
    new = np.concatenate([m.full_pages[m.swa_pages > 0] for m in d.maps])
    assert sorted(new.tolist()) == sorted(set(new.tolist()))
    assert len(new) == full_pages
    unmapped = np.concatenate([m.full_pages[m.swa_pages == 0] for m in d.maps])
    assert len(unmapped) == 11
    assert np.array_equal(d.runner_map(), d.ledger.swa.map)


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


# ---- issue 26: the tree's dead pages never reach a window that reads them ---------------
def window_is_alive(d: Driver, rid: int, first_query: int, end: int) -> list[int]:
    """Positions in the windows of queries [first_query, end) whose page has no sliding KV
    (in the ledger's map or the runner's): [] when every read finds its KV."""
    rec = d.ledger.records[rid]
    row = d.ledger.table.table[rec.req_pool_idx]
    lo = max(first_query - WINDOW + 1, 0)
    pages = row[lo:end] // PS
    runner = d.runner_map()
    dead = (d.ledger.swa.map[pages] == 0) | (runner[pages] != d.ledger.swa.map[pages])
    return (np.flatnonzero(dead) + lo).tolist()


def chunked(d: Driver, rid: int, tokens, budget: int, match_prefix=True, session=""):
    """Prefill in chunks with cache_unfinished between them, checking each chunk's windows
    read live sliding KV; the first grant."""
    first = None
    while True:
        deltas = []
        g = run_sync(
            d.ledger.alloc_extend(
                rid, tokens, budget, deltas, match_prefix=match_prefix, session=session
            )
        )
        assert g is not None
        d.maps += [x for x in deltas if isinstance(x, SwaMapDelta)]
        d.check()
        first = first or g
        assert window_is_alive(d, rid, g.start, g.end) == [], f"chunk [{g.start}, {g.end})"
        if g.end == len(tokens):
            return first
        deltas = []
        run_sync(d.ledger.cache_unfinished(rid, tokens, deltas))
        d.maps += [x for x in deltas if isinstance(x, SwaMapDelta)]
        d.check()


def dead_tree_pages(d: Driver) -> int:
    """Tree pages whose sliding KV is gone."""
    return int((d.ledger.swa.map[d.tree.owned_pages()] == 0).sum())


def long_finished_request(d: Driver, rid=1, prompt_len=8, new=60):
    """A request whose output ran past the window: its tree path has dead pages."""
    prompt = toks(rid, prompt_len)
    d.extend(rid, prompt)
    d.decode(rid, new)
    hist = np.concatenate([prompt, toks(rid + 100, new + 1)])
    d.finish(rid, hist)
    assert dead_tree_pages(d)  # the window freed some of the output's sliding pages
    return hist


@pytest.mark.parametrize("match_prefix", [True, False], ids=["diverging", "prompt_logprobs"])
def test_chunks_over_a_cached_long_output_read_live_sliding_kv(match_prefix):
    d = Driver(free_prompt=False)
    hist = long_finished_request(d)
    # Diverges inside the earlier output, past the window: the match is cut where its
    # window is intact and the rest is recomputed in chunks over the tree's dead pages.
    prompt = np.concatenate([hist[:56], toks(7, 6)])
    chunked(d, 2, prompt, budget=8, match_prefix=match_prefix)
    d.decode(2, 3)
    d.finish(2, np.concatenate([prompt, toks(8, 4)]))
    assert run_sync(d.ledger.idle_problems()) == []


def test_a_chunk_never_takes_a_dead_page_another_request_locks():
    d = Driver(free_prompt=False)
    hist = long_finished_request(d)
    # Request 2 holds the long path (its window at the end is intact): the dead pages in
    # the middle are locked and cannot heal.
    g = d.extend(2, np.concatenate([hist, toks(9, 2)]))
    assert g.cached_len == 68
    prompt = np.concatenate([hist[:56], toks(7, 6)])
    chunked(d, 3, prompt, budget=8, match_prefix=False)
    rec = d.ledger.records[3]
    row = d.ledger.table.table[rec.req_pool_idx]
    assert (d.ledger.swa.map[row[: rec.kv_committed_len] // PS][-WINDOW // PS :] > 0).all()


def test_the_same_long_prompt_twice_is_cached_whole_the_second_time():
    d = Driver(free_prompt=False)
    hist = long_finished_request(d)
    for rid in (2, 3):
        g = chunked(d, rid, hist, budget=8, match_prefix=False)
        d.finish(rid, hist)
    g = d.extend(4, np.concatenate([hist, toks(5, 3)]))
    assert g.cached_len == len(hist) - len(hist) % PS
    assert dead_tree_pages(d) == 0  # the fresh pages replaced the dead ones
    assert d.ledger.counters.tree_heals > 0
    d.check()


def test_a_session_restored_after_decoding_past_the_window_passes_the_checker():
    d = Driver(free_prompt=False)
    d.ledger.open_slot("s")
    prompt = toks(1, 10)
    d.extend(1, prompt, session="s")
    d.decode(1, 50)
    hist = np.concatenate([prompt, toks(2, 51)])
    d.finish(1, hist)
    assert d.ledger.slots["s"].rec.swa_evicted_seqlen > 0
    turn = np.concatenate([hist, toks(3, 20)])
    g = d.extend(2, turn, session="s")  # the checker runs inside
    assert g.cached_len == len(hist) - 1  # the last sampled token has no KV
    rec = d.ledger.records[2]
    # The floor never covers KV the window already freed.
    assert rec.swa_evict_floor <= rec.swa_evicted_seqlen or rec.swa_evicted_seqlen == 0
    d.decode(2, 30)
    d.finish(2, np.concatenate([turn, toks(4, 31)]))
    assert run_sync(d.ledger.idle_problems()) == []


def test_the_runner_learns_every_unmapping_before_a_page_is_mapped_again():
    d = Driver(num_pages=64, swa_pages=10)
    hist = long_finished_request(d, prompt_len=4, new=30)
    run_sync(d.ledger.drop_cache())  # unmaps everything; no deltas go out here
    assert not np.array_equal(d.runner_map(), d.ledger.swa.map)
    d.extend(2, toks(2, 20))  # the pending unmappings lead this reply's deltas
    assert np.array_equal(d.runner_map(), d.ledger.swa.map)
    del hist


def test_a_session_restore_never_reads_dead_tree_pages_in_its_window():
    """Page size 1, window 4. A session turn computed without the prefix cache takes dead
    tree pages below its window (another request locks them, so they cannot heal); a later
    turn restoring at 9 would read positions 6..8 through them: it must not restore."""
    ledger, _ = make_ledger(200, 1, 8, 64)
    ledger.swa, ledger.window, ledger.swa_free_step = SwaPages(200, 200, 1), 4, 1
    t = np.arange(1000, 1040, dtype=np.int64)
    run_sync(ledger.alloc_extend(1, t[:2], 100, []))
    while ledger.records[1].kv_committed_len < 20:
        run_sync(ledger.alloc_decode([1], []))
    run_sync(ledger.finish(1, t[:21]))  # the tree holds 20 tokens, [2, 16) dead
    ledger.forget(1)
    run_sync(ledger.alloc_extend(2, t[:21], 100, []))  # locks the whole path
    ledger.open_slot("s")
    run_sync(ledger.alloc_extend(3, t[:25], 12, [], match_prefix=False, session="s"))
    run_sync(ledger.cache_unfinished(3, t[:25], []))
    run_sync(ledger.alloc_extend(3, t[:25], 100, []))
    run_sync(ledger.alloc_decode([3], []))
    run_sync(ledger.finish(3, t[:26]))
    ledger.forget(3)
    turn = np.concatenate([t[:9], np.arange(5000, 5010)])
    g = run_sync(ledger.alloc_extend(4, turn, 100, [], session="s"))
    row = ledger.table.table[ledger.records[4].req_pool_idx]
    lo = max(g.start - 4 + 1, 0)
    assert (ledger.swa.map[row[lo : g.end]] > 0).all(), (g, lo)
    check_invariants(run_sync(ledger.snapshot()))
