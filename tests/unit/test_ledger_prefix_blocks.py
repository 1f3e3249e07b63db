"""Prefix-tree blocks below the pool: a block the pool evicts is copied to the host tier,
and a later request whose prompt starts with it loads it instead of prefilling it.

As in the session tier tests, every operation is followed by the exact invariant checker
(the tiers' conservation and the prefix index's ownership included), and `FakeKv` checks
that every loaded position maps to the KV written for its token at its position.
"""

from __future__ import annotations

import numpy as np

from kvcore.tiers import PrefixIndex
from tests.unit.ledger_driver import run_sync
from tests.unit.test_ledger_tiers import PS, Driver, toks, with_disk


def blocks_driver(num_pages=24, budget=1 << 20, swa=False) -> Driver:
    d = Driver(num_pages=num_pages, budget=budget, swa=swa)
    d.ledger.prefix_blocks = PrefixIndex(PS)
    return d


def served(d: Driver, rid: int, prompt, new_tokens) -> np.ndarray:
    """A whole request (no session): its prompt and output end in the prefix tree."""
    d.ledger.open_slot("_")  # the driver's turn helper wants a session; none is used
    g = d.extend(rid, prompt)
    assert g is not None
    tokens = np.concatenate([prompt, new_tokens]).astype(np.int64)
    for i in range(len(new_tokens) - 1):
        d.decode(rid, tokens[: len(prompt) + i + 1])
    d.finish(rid, tokens)
    return tokens


def pressure(d: Driver, rid: int, n: int) -> None:
    """A request that needs `n` tokens of pages, then ends (aborted: its pages go free, not
    to the tree)."""
    assert d.extend(rid, toks(rid, n)) is not None
    d.abort(rid)


def test_an_evicted_prompt_is_kept_below_the_pool_and_a_later_request_loads_it():
    d = blocks_driver()
    system = toks(1, 40)  # 10 pages
    served(d, 1, np.concatenate([system, toks(2, 3)]), toks(3, 1))
    pressure(d, 50, 90)  # 23 of 24 pages: the tree gives up the prompt's 10
    assert d.ledger.counters.block_demotes == 1 and len(d.ledger.prefix_blocks) == 1
    assert d.ledger.counters.evicted_pages == 10
    prompt = np.concatenate([system, toks(9, 5)])
    g = d.extend(2, prompt)
    assert (g.cached_len, g.start) == (40, 40)
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    assert d.ledger.counters.block_loaded_tokens == 40
    assert d.ledger.records[2].cache_protected_len == 0  # the loaded pages are its own
    # The block stays stored: the next eviction of the same prompt copies nothing.
    assert len(d.ledger.prefix_blocks) == 1
    d.finish(2, np.concatenate([prompt, toks(4, 1)]))
    assert run_sync(d.ledger.idle_problems(audit_store=True)) == []


def test_a_block_the_tiers_hold_already_is_not_copied_again():
    d = blocks_driver()
    system = toks(1, 40)
    served(d, 1, np.concatenate([system, toks(2, 1)]), toks(3, 1))
    pressure(d, 50, 90)
    saves = len(d.port.entries)
    served(d, 2, np.concatenate([system, toks(4, 1)]), toks(5, 1))  # loads it, then caches it
    pressure(d, 51, 90)  # evicted again: the same 40 positions
    assert d.ledger.counters.block_demotes == 1
    assert d.ledger.counters.block_demote_skips == 1 and len(d.port.entries) == saves


def test_blocks_evicted_apart_load_as_one_chain():
    d = blocks_driver(num_pages=32)
    system = toks(1, 40)
    a = served(d, 1, np.concatenate([system, toks(2, 21)]), toks(3, 1))  # a child of 5 pages
    served(d, 2, np.concatenate([system, toks(4, 21)]), toks(5, 1))  # a sibling
    pressure(d, 50, 124)  # 31 of 32 pages: all of the tree goes, leaves first
    assert d.ledger.counters.block_demotes == 3
    prompt = np.concatenate([a[:60], toks(9, 3)])
    g = d.extend(3, prompt)
    assert (g.cached_len, g.start) == (60, 60)  # [0, 40) and [40, 60) from two blocks
    assert [load[1:] for load in d.port.loads] == [(0, 40), (0, 20)]
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_a_request_takes_what_the_tree_still_holds_and_loads_the_rest():
    d = blocks_driver(num_pages=32)
    system = toks(1, 40)
    a = served(d, 1, np.concatenate([system, toks(2, 21)]), toks(3, 1))
    served(d, 2, np.concatenate([system, toks(4, 21)]), toks(5, 1))
    pressure(d, 50, 88)  # 22 of 32 pages: the two 5-page leaves go, [0, 40) stays
    assert d.ledger.counters.block_demotes == 2
    prompt = np.concatenate([a[:60], toks(9, 3)])
    g = d.extend(3, prompt)
    assert (g.cached_len, g.start) == (60, 60)
    assert d.ledger.records[3].cache_protected_len == 40  # shared with the tree
    assert [load[1:] for load in d.port.loads] == [(0, 20)]
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_only_pages_with_their_sliding_kv_are_kept_and_the_window_reads_its_own():
    d = blocks_driver(num_pages=40, swa=True)
    system = toks(1, 40)
    # 30 output tokens: the window (16) frees the sliding KV of the output it passed, so
    # the tree's node has dead pages after the prompt's.
    out = served(d, 1, np.concatenate([system, toks(2, 2)]), toks(3, 30))
    assert d.ledger.counters.swa_freed_pages > 0
    pressure(d, 50, 156)  # 39 of 40 pages
    blocks = [d.ledger.host.entries[h] for h in d.ledger.prefix_blocks.keys]
    assert [(b.start, b.length) for b in blocks] == [(0, 44)]  # up to the first dead page
    prompt = np.concatenate([out[:44], toks(9, 10)])
    g = d.extend(2, prompt)
    assert (g.cached_len, g.start) == (44, 44)
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    d.assert_window_holds(g.row, prompt, len(prompt))


def test_a_failed_load_computes_from_that_block_on_and_drops_it():
    d = blocks_driver()
    system = toks(1, 40)
    served(d, 1, np.concatenate([system, toks(2, 3)]), toks(3, 1))
    pressure(d, 50, 90)
    d.port.fail = {"load"}
    prompt = np.concatenate([system, toks(9, 5)])
    g = d.extend(2, prompt, budget=20)
    assert (g.cached_len, g.start, g.end) == (0, 0, 20)  # within the step's budget
    assert d.ledger.counters.tier_failures == 1 and len(d.ledger.prefix_blocks) == 0
    assert d.port.entries == {}
    d.kv.assert_row_holds(g.row, prompt, 20)


def test_a_failed_copy_forgets_the_block_as_without_a_tier():
    d = blocks_driver()
    served(d, 1, np.concatenate([toks(1, 40), toks(2, 3)]), toks(3, 1))
    d.port.fail = {"save"}
    pressure(d, 50, 90)
    assert d.ledger.counters.tier_failures == 1 and len(d.ledger.prefix_blocks) == 0
    assert d.ledger.counters.evicted_pages == 10 and d.ledger.host.used == 0


def test_blocks_and_sessions_share_the_budget_least_recently_used_first():
    d = blocks_driver(budget=8 * 45)  # one 40-position block fits, not two
    first, second = toks(1, 40), toks(2, 40)
    served(d, 1, np.concatenate([first, toks(3, 1)]), toks(4, 1))
    pressure(d, 50, 90)
    served(d, 2, np.concatenate([second, toks(5, 1)]), toks(6, 1))
    pressure(d, 51, 90)
    assert d.ledger.counters.block_demotes == 2 and d.ledger.counters.tier_drops == 1
    g = d.extend(3, np.concatenate([first, toks(7, 3)]))
    assert g.cached_len == 0  # the older block was dropped for the newer
    d.abort(3)
    g = d.extend(4, np.concatenate([second, toks(8, 3)]))
    assert g.cached_len == 40


def test_drop_cache_forgets_the_blocks_with_the_store():
    d = blocks_driver()
    served(d, 1, np.concatenate([toks(1, 40), toks(2, 3)]), toks(3, 1))
    pressure(d, 50, 90)
    run_sync(d.ledger.drop_cache())
    d.port.entries.clear()  # the restarted runner's store
    d.check()
    assert len(d.ledger.prefix_blocks) == 0 and d.ledger.host.used == 0


def test_a_new_sessions_first_turn_loads_blocks_too():
    d = blocks_driver(num_pages=32)
    system = toks(1, 40)
    served(d, 1, np.concatenate([system, toks(2, 3)]), toks(3, 1))
    pressure(d, 50, 124)
    d.ledger.open_slot("s")
    prompt = np.concatenate([system, toks(9, 6)])
    g = d.extend(2, prompt, session="s")  # a new session's first turn: from the block
    assert g.cached_len == 40
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_a_demoted_sessions_pages_are_freed_not_cached_so_nothing_is_copied_twice():
    d = blocks_driver(num_pages=32)
    d.ledger.session_max_pages = 0  # the finished turn is demoted at once
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 40), toks(2, 6), "s")  # 45 positions in its entry
    assert d.ledger.counters.session_demotes == 1
    assert d.ledger.pool.num_free == 32  # its pages went free, not into the tree
    pressure(d, 50, 124)
    assert d.ledger.counters.evicted_pages == 0 and d.ledger.counters.block_demotes == 0
    assert len(d.port.entries) == 1
    prompt = np.concatenate([hist, toks(3, 4)])
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 45
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_one_eviction_copies_at_most_half_the_host_tier():
    d = blocks_driver(budget=8 * 80)  # an allowance of 40 positions per eviction
    served(d, 1, np.concatenate([toks(1, 40), toks(2, 1)]), toks(3, 1))
    served(d, 2, np.concatenate([toks(4, 40), toks(5, 1)]), toks(6, 1))
    pressure(d, 50, 90)  # both 10-page blocks go; only the first is copied
    assert d.ledger.counters.evicted_pages == 20
    assert d.ledger.counters.block_demotes == 1 and d.ledger.host.used == 8 * 40


def test_a_block_nobody_loaded_leaves_before_a_sessions_entry_and_is_not_written_to_disk():
    d = with_disk(blocks_driver(), host_budget=8 * 45)  # one entry fits in the host
    d.ledger.open_slot("s")
    d.ledger.session_max_pages = 0
    d.turn(1, toks(1, 30), toks(2, 6), "s")  # 35 positions demoted at once
    d.ledger.session_max_pages = None
    served(d, 2, np.concatenate([toks(3, 40), toks(4, 1)]), toks(5, 1))
    pressure(d, 50, 90)  # the 40-position block is copied, then dropped to fit
    assert d.ledger.counters.block_demotes == 1 and len(d.ledger.prefix_blocks) == 0
    assert d.ledger.slots["s"].stored in d.ledger.host.entries  # the session stayed
    assert d.ledger.counters.tier_spills == 0 and d.port.on_disk == set()
