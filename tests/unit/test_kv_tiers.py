"""kvcore.tiers: the host tier's accounting, its checker, and what a promotion may load."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.tiers import (
    BlockLoad,
    KvTier,
    PrefixIndex,
    Promotion,
    TierEntry,
    TierViolation,
    check_tiers,
    plan_block_loads,
    plan_promotion,
)

PS = 4


def entry(handle=1, n=40, alive=None, nbytes=100, last_used=0) -> TierEntry:
    return TierEntry(handle, np.arange(n, dtype=np.int64), alive, nbytes, last_used)


def pages(pattern: str) -> np.ndarray:
    """'1' alive, '0' dead, one character per page."""
    return np.array([c == "1" for c in pattern])


def test_a_promotion_loads_what_the_tree_lacks_and_nothing_when_it_lacks_nothing():
    e = entry(n=40)
    assert plan_promotion(e, 40, 16, 0, PS) == Promotion(40, 16, 16)
    assert plan_promotion(e, 30, 0, 0, PS) == Promotion(30, 0, 0)  # a diverged prompt
    assert plan_promotion(e, 60, 8, 0, PS) == Promotion(40, 8, 8)  # the entry's end
    assert plan_promotion(e, 16, 16, 0, PS) is None  # the tree has it all
    assert plan_promotion(e, 12, 16, 0, PS) is None


def test_a_promotion_needs_the_first_query_window_alive_and_one_dead_run():
    # 10 pages, window 8: the last two pages (positions 32..39) alive, the rest dead.
    e = entry(n=40, alive=pages("0000000011"))
    # Loaded [0, 40): pages 0..7 dead as one run; the query at 40 reads 33..39: alive.
    assert plan_promotion(e, 40, 0, 8, PS) == Promotion(40, 0, 32)
    assert plan_promotion(e, 40, 16, 8, PS) == Promotion(40, 16, 32)  # tree had 0..15
    # A prompt diverging at 30 would read 23..29: dead pages, so it prefills.
    assert plan_promotion(e, 30, 0, 8, PS) is None
    # Two dead runs cannot be one record's freed range.
    assert plan_promotion(entry(n=40, alive=pages("0011001111")), 40, 0, 8, PS) is None
    # Alive below a dead run: the record's floor keeps [0, 8), the window freed [8, 24).
    assert plan_promotion(entry(n=40, alive=pages("1100001111")), 40, 0, 8, PS) == Promotion(
        40, 8, 24
    )
    assert plan_promotion(entry(n=40, alive=pages("1111111111")), 40, 0, 8, PS) == Promotion(
        40, 0, 0
    )


def test_saved_sliding_positions_follow_the_alive_pages():
    e = entry(n=10, alive=pages("011"))  # positions 4..9 saved (the last page is partial)
    assert e.saved_swa_positions(PS).tolist() == [4, 5, 6, 7, 8, 9]
    assert entry(n=10).saved_swa_positions(PS).size == 0


def test_the_host_tier_counts_bytes_and_orders_by_use():
    tier = KvTier("host", budget=250)
    tier.add(entry(1, nbytes=100, last_used=5))
    tier.add(entry(2, nbytes=100, last_used=3))
    assert tier.used == 200 and not tier.over_budget()
    with pytest.raises(TierViolation, match="twice"):
        tier.add(entry(1))
    tier.add(entry(3, nbytes=100, last_used=9))
    assert tier.over_budget() and tier.least_recent() == [2, 1, 3]
    assert tier.remove(2).handle == 2 and tier.used == 200


def test_the_checker_names_every_broken_rule():
    tier = KvTier("host", budget=250)
    tier.add(entry(1))
    tier.add(entry(2))
    check_tiers([tier], {"a": 1, "b": 2}, {"c"}, {1: ("host", 100), 2: ("host", 100)})
    with pytest.raises(TierViolation, match="belong to no session"):
        check_tiers([tier], {"a": 1}, set())
    with pytest.raises(TierViolation, match="belongs to 'a' and 'b'"):
        check_tiers([tier], {"a": 1, "b": 1}, set())
    with pytest.raises(TierViolation, match="not stored"):
        check_tiers([tier], {"a": 1, "b": 2, "c": 7}, set())
    with pytest.raises(TierViolation, match="pool KV and a stored entry"):
        check_tiers([tier], {"a": 1, "b": 2}, {"a"})
    with pytest.raises(TierViolation, match="disagrees"):
        check_tiers([tier], {"a": 1, "b": 2}, set(), {1: ("host", 100)})
    tier.used = 150
    with pytest.raises(TierViolation, match="host tier counts 150 bytes"):
        check_tiers([tier], {"a": 1, "b": 2}, set())
    tier.used, tier.budget = 200, 150
    with pytest.raises(TierViolation, match="over its 150 budget"):
        check_tiers([tier], {"a": 1, "b": 2}, set())


def test_an_entry_lives_in_one_tier_and_the_store_must_agree_on_which():
    host, disk = KvTier("host", 1000), KvTier("disk", 1000)
    host.add(entry(1))
    disk.add(entry(2, nbytes=60))
    check_tiers([host, disk], {"a": 1, "b": 2}, set(), {1: ("host", 100), 2: ("disk", 60)})
    with pytest.raises(TierViolation, match="other tier or size"):
        check_tiers([host, disk], {"a": 1, "b": 2}, set(), {1: ("host", 100), 2: ("host", 60)})
    disk.add(entry(1))
    with pytest.raises(TierViolation, match="in the host and disk tiers"):
        check_tiers([host, disk], {"a": 1, "b": 2}, set())


def test_prefix_blocks_chain_from_the_tree_match_as_far_as_whole_pages_agree():
    index = PrefixIndex(4)
    tokens = np.arange(100, 140, dtype=np.int64)
    a = TierEntry(1, tokens[:16].copy(), None, 8, start=8)  # positions [8, 16)
    b = TierEntry(2, tokens[:28].copy(), None, 8, start=16)  # positions [16, 28)
    entries = {1: a, 2: b}
    index.add(a)
    index.add(b)
    assert plan_block_loads(index, entries.get, tokens, 8) == [
        BlockLoad(1, 8, 16),
        BlockLoad(2, 16, 28),
    ]
    assert plan_block_loads(index, entries.get, tokens, 4) == []  # no block starts at 4
    edited = tokens.copy()
    edited[21] = 7  # the second block agrees for one page only
    assert plan_block_loads(index, entries.get, edited, 8) == [
        BlockLoad(1, 8, 16),
        BlockLoad(2, 16, 20),
    ]
    assert plan_block_loads(index, entries.get, tokens[:18], 8) == [BlockLoad(1, 8, 16)]
    with pytest.raises(TierViolation, match="indexed twice"):
        index.add(TierEntry(3, tokens[:16].copy(), None, 8, start=8))


def test_the_checker_holds_each_prefix_block_to_the_index():
    index = PrefixIndex(4)
    tokens = np.arange(100, 140, dtype=np.int64)
    host = KvTier("host", 100)
    block = TierEntry(1, tokens[:16].copy(), None, 8, start=8)
    host.add(block)
    with pytest.raises(TierViolation, match="belong to no session"):
        check_tiers([host], {}, set(), prefix_blocks=index)
    index.add(block)
    check_tiers([host], {}, set(), prefix_blocks=index)
    with pytest.raises(TierViolation, match="belongs to 'the prefix index' and 's'"):
        check_tiers([host], {"s": 1}, set(), prefix_blocks=index)
    block.tokens[0] = 7  # its tokens no longer hash to the key it is found under
    with pytest.raises(TierViolation, match="indexed under another prefix"):
        check_tiers([host], {}, set(), prefix_blocks=index)
    block.tokens[0] = 100
    index.remove(1)
    block.start = 6  # not a page boundary, yet indexed under its own prefix
    index.add(block)
    with pytest.raises(TierViolation, match="not whole pages"):
        check_tiers([host], {}, set(), prefix_blocks=index)
    index.handles[b"other"] = 1  # two keys name one handle
    with pytest.raises(TierViolation, match="keys and handles disagree"):
        check_tiers([host], {}, set(), prefix_blocks=index)
    index.handles = {index.keys[1]: 1}
    index.remove(1)
    host.remove(1)
    index.keys[9] = b"x"  # the index names a handle no tier holds
    index.handles[b"x"] = 9
    with pytest.raises(TierViolation, match="names handle 9"):
        check_tiers([host], {}, set(), prefix_blocks=index)
