"""The prefix tree's digest: what a router matches prompts against (kvcore.prefix_digest)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore import RadixTree
from kvcore.prefix_digest import matched_blocks, pack, prefix_hashes, unpack
from kvcore.salt import salted_tokens
from tests.unit.ledger_driver import expected_dead_ends

BLOCK = 8


def _tree_with(seqs: list[np.ndarray], page_size: int = 4) -> RadixTree:
    tree = RadixTree(page_size, digest_block=BLOCK)
    slot = 0
    for seq in seqs:
        slots = np.arange(slot, slot + len(seq), dtype=np.int64)
        slot += len(seq)
        tree.insert(seq, slots)
    return tree


def _expected(seqs: list[np.ndarray], page_size: int = 4) -> set[int]:
    """Every whole block of every inserted (page-floored) sequence."""
    out: set[int] = set()
    for seq in seqs:
        out |= set(prefix_hashes(seq[: len(seq) // page_size * page_size], BLOCK))
    return out


def test_digest_holds_every_whole_block_prefix_of_a_branching_tree():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, 21)
    seqs = [np.concatenate([shared, rng.integers(0, 1000, n)]) for n in (3, 17, 40, 0)]
    seqs.append(rng.integers(0, 1000, 33))
    tree = _tree_with(seqs)
    hashes, truncated = tree.digest()
    assert not truncated
    assert len(hashes) == len(set(hashes))  # one entry per prefix, however the tree split
    assert set(hashes) == _expected(seqs)


def test_a_prompt_matches_as_many_blocks_as_the_tree_holds_of_it():
    rng = np.random.default_rng(1)
    cached = rng.integers(0, 1000, 64)
    tree = _tree_with([cached])
    held, _ = tree.digest()
    prompt = np.concatenate([cached[:44], rng.integers(1000, 2000, 30)])
    assert matched_blocks(prefix_hashes(prompt, BLOCK), set(held)) == 44 // BLOCK
    other = rng.integers(1000, 2000, 64)
    assert matched_blocks(prefix_hashes(other, BLOCK), set(held)) == 0
    # a different cache_salt is a different key space: nothing of the same text matches
    salted = salted_tokens(cached, "tenant-a")
    assert matched_blocks(prefix_hashes(salted, BLOCK), set(held)) == 0


def test_version_moves_with_the_content_only():
    tree = _tree_with([np.arange(32)])
    v = tree.version
    tree.match_prefix(np.arange(16))  # a split, same content
    tree.insert(np.arange(16), np.arange(100, 116))  # already held
    assert tree.version == v
    tree.insert(np.arange(40), np.arange(200, 240))
    assert tree.version == v + 1
    assert len(tree.evict(100)) > 0
    assert tree.version == v + 2
    assert tree.digest() == ([], False)
    assert len(tree.evict(100)) == 0
    assert tree.version == v + 2  # nothing evicted, nothing changed


def test_eviction_takes_the_leaf_blocks_out_of_the_digest():
    seqs = [np.arange(48), np.concatenate([np.arange(24), np.arange(500, 524)])]
    tree = _tree_with(seqs)
    tree.match_prefix(seqs[0])  # the other branch is now least recently used
    tree.evict(1)
    hashes, _ = tree.digest()
    assert set(hashes) == _expected([seqs[0], seqs[1][:24]])


def _recomputed(tree: RadixTree) -> set[int]:
    """The oracle: every unsalted whole-block prefix of every path, hashed afresh."""
    snap = tree.snapshot()
    keys = dict(zip(snap.ids, snap.keys, strict=True))
    parents = dict(zip(snap.ids, snap.parents, strict=True))
    out: set[int] = set()
    for nid in snap.ids:
        path, at = [], nid
        while at != tree.ROOT_ID:
            path.append(keys[at])
            at = parents[at]
        seq = np.concatenate(path[::-1])
        if len(seq) and int(seq[0]) >> 32 == 0:
            out |= set(prefix_hashes(seq, BLOCK))
    return out


def _random_key(rng, stems, vocab: int, tail: int, salted: float) -> np.ndarray:
    """A prefix of one of `stems` and up to `tail` random tokens; salted at that rate."""
    stem = stems[int(rng.integers(len(stems)))]
    seq = np.concatenate(
        [
            stem[: int(rng.integers(0, len(stem) + 1))],
            rng.integers(0, vocab, int(rng.integers(0, tail))),
        ]
    )
    return salted_tokens(seq, "t") if rng.random() < salted else seq


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_the_kept_digest_equals_one_made_afresh_through_inserts_splits_and_evictions(
    seed, page_size
):
    rng = np.random.default_rng(seed)
    tree = RadixTree(page_size, digest_block=BLOCK)
    stems = [rng.integers(0, 50, int(rng.integers(1, 40))) for _ in range(5)]
    slot = 0
    for step in range(120):
        op = rng.random()
        if op < 0.6:
            seq = _random_key(rng, stems, vocab=50, tail=30, salted=0.2)
            tree.insert(seq, np.arange(slot, slot + len(seq)))
            slot += len(seq)
        elif op < 0.8:
            tree.match_prefix(stems[int(rng.integers(len(stems)))])  # may split
        else:
            tree.evict(int(rng.integers(1, 6)))
        assert set(tree.digest()[0]) == _recomputed(tree), step
    assert len(tree.digest()[0]) == len(set(tree.digest()[0]))


def test_salted_prefixes_are_not_listed():
    tree = _tree_with([salted_tokens(np.arange(40), "tenant-a")])
    assert tree.digest() == ([], False) and tree.total_size == 40


def test_a_truncated_digest_stays_closed_under_prefixes():
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 1000, 64) for _ in range(6)]
    tree = _tree_with(seqs)
    hashes, truncated = tree.digest(limit=20)
    assert truncated and len(hashes) == 20
    held = set(hashes)
    for seq in seqs:
        chain = prefix_hashes(seq, BLOCK)
        k = matched_blocks(chain, held)
        assert all(h not in held for h in chain[k:])  # no hole: whole leading runs only


def test_hashes_are_stable_and_pack_round_trips():
    # fixed values: a router and a replica on other machines must agree
    assert prefix_hashes(np.arange(16), 8) == prefix_hashes(list(range(16)), 8)
    first = prefix_hashes(np.arange(16), 8)
    assert first == prefix_hashes(np.arange(17), 8)  # a partial block adds nothing
    assert unpack(pack(first)) == set(first)
    with pytest.raises(ValueError, match="8-byte"):
        unpack(b"abc")


def test_hashes_pinned_to_known_values():
    # a change here breaks routing between a router and replicas of different versions
    assert prefix_hashes(np.arange(4), 4) == [7802164138452766617]
    assert prefix_hashes([5, 2**40 + 7, 3, 1], 2) == [14982924274886903334, 18004310441798214830]


# ---- dead ends: where a sliding window's KV is gone ------------------------------------


def _window_rule(window: int, page_size: int):
    """The ledger's `_swa_usable` rule: a request resumes right after `end` when every page
    of the window its next query reads, [end - window + 1, end), has its sliding KV."""

    def resumable(slots, alive, end) -> bool:
        first = max(end - window + 1, 0) // page_size
        return bool(alive[first : -(-end // page_size)].all())

    return resumable


def test_a_prefix_whose_window_is_gone_is_a_dead_end():
    # positions [0, 20) lost their sliding KV to the window (an output decoded past it)
    tree = RadixTree(1, digest_block=4, window=8)
    seq = np.arange(100, 132)
    alive = np.arange(32) >= 20
    tree.insert(seq, np.arange(32), alive=alive)
    chain = prefix_hashes(seq, 4)  # ends 4, 8, ..., 32
    # end 24 reads [17, 24): dead; end 28 reads [21, 28): whole
    assert set(tree.dead_ends()) == set(chain[:6])
    assert set(tree.digest()[0]) == set(chain)
    # a fresh request over the same tokens with its own live KV heals the tree's pages
    version = tree.version
    tree.insert(seq, np.arange(40, 72))
    assert tree.dead_ends() == [] and tree.version == version + 1


def test_no_window_no_dead_ends():
    tree = RadixTree(1, digest_block=4)
    tree.insert(np.arange(32), np.arange(32), alive=np.zeros(32, dtype=bool))
    assert tree.dead_ends() == [] and len(tree.digest()[0]) == 8


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_dead_ends_equal_the_window_rule_through_inserts_heals_splits_and_evictions(
    seed, page_size
):
    rng = np.random.default_rng(seed)
    window = int(rng.integers(2, 12))
    block = 2 * page_size
    tree = RadixTree(page_size, digest_block=block, window=window)
    rule = _window_rule(window, page_size)
    stems = [rng.integers(0, 20, int(rng.integers(4, 48))) for _ in range(4)]
    slot, locked = 0, []
    for step in range(150):
        op = rng.random()
        if op < 0.55:
            seq = _random_key(rng, stems, vocab=20, tail=24, salted=0.1)
            pages = len(seq) // page_size
            # a request's row: pages the window passed are dead, sometimes all alive
            dead_below = int(rng.integers(0, pages + 1)) if rng.random() < 0.7 else 0
            alive = np.arange(pages) >= dead_below
            res = tree.insert(seq, np.arange(slot, slot + len(seq)), alive=alive)
            slot += len(seq)
            if res.node_id != tree.ROOT_ID and rng.random() < 0.2:
                tree.inc_lock_ref(res.node_id)  # a locked node is never healed
                locked.append(res.node_id)
        elif op < 0.7:
            tree.match_prefix(stems[int(rng.integers(len(stems)))])  # may split
        elif op < 0.8 and locked:
            tree.dec_lock_ref(locked.pop(int(rng.integers(len(locked)))))
        else:
            tree.evict(int(rng.integers(1, 6)))
        assert set(tree.dead_ends()) == expected_dead_ends(tree, rule), step
        assert set(tree.dead_ends()) <= set(tree.digest()[0])
