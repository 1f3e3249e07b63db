"""The host tier in the ledger: demote an idle session, promote its next turn, the budget.

Every operation is followed by the exact invariant checker (the tier's conservation
included), and `FakeKv` checks that a promoted row maps every position to the KV that was
written for its token, through a `FakeTierPort` that copies the fake runner's arrays out
and back as the runner's store does.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcore import InvariantViolation, SwaPages, check_invariants
from kvcore.tiers import KvTier, TierEntry
from tests.unit.ledger_driver import FakeKv, FakeTierPort, run_sync
from tests.unit.test_ledger_sessions import Driver as SessionsDriver

PS, WINDOW = 4, 16


class Driver(SessionsDriver):
    """The sessions tests' driver with a host tier of `budget` bytes; with `swa`, two pools
    (window 16, freed in steps of a page). Its check also audits the tiers and the store."""

    def __init__(self, num_pages=64, rows=8, capacity=256, budget=1 << 20, swa=False, cls=None):
        super().__init__(num_pages, rows, capacity, cls=cls)
        self.kv = FakeKv((num_pages + 1) * PS, PS, swa_pages=num_pages if swa else 0)
        if swa:
            self.ledger.swa = SwaPages(num_pages, num_pages, PS)
            self.ledger.window = WINDOW
            self.ledger.swa_free_step = PS
        self.port = FakeTierPort(self.kv)
        self.ledger.tiers = self.port
        self.ledger.host = KvTier("host", budget)

    def check(self) -> None:
        super().check()
        assert self.problems() == []

    def problems(self) -> list[str]:
        if self.ledger.host is None:
            return []
        return run_sync(self.ledger._tier_problems(audit_store=True))

    def evict_tree(self) -> None:
        """The tree loses every unlocked page (pressure elsewhere)."""
        freed = run_sync(self.tree_port().evict(self.ledger.pool.num_pages))
        with_ledger_writes(lambda: self.ledger._free_pages(freed))
        self.check()

    def tree_port(self):
        return self.ledger.tree

    def assert_window_holds(self, row, tokens, end) -> None:
        """The sliding KV of the window a query at `end` reads holds the right tokens."""
        slots = self.kv.replica[row][max(end - WINDOW + 1, 0) : end]
        swa = self.kv.sliding_slots(slots)
        assert (swa >= PS).all(), "a window position has no sliding page"
        assert (self.kv.swa_token[swa] == tokens[max(end - WINDOW + 1, 0) : end]).all()


def with_ledger_writes(fn):
    from kvcore.req_kv_info import ledger_writes

    with ledger_writes():
        return fn()


def toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 5000, n).astype(np.int64)


def demoted_session(d: Driver, sid="s", seed=1, prompt_len=30, new=6):
    """A session with one finished turn whose KV the cap (0 pages) demoted at once."""
    d.ledger.session_max_pages = 0
    d.ledger.open_slot(sid)
    _, hist = d.turn(seed, toks(seed, prompt_len), toks(seed + 100, new), sid)
    slot = d.ledger.slots[sid]
    assert slot.rec is None and slot.stored is not None
    return hist


def test_a_demoted_session_holds_no_pool_page_and_its_next_turn_loads_what_the_tree_lost():
    d = Driver()
    hist = demoted_session(d)  # 35 positions with KV (the last sampled token has none)
    entry = d.ledger.host.entries[d.ledger.slots["s"].stored]
    assert entry.length == 35 and d.ledger.host.used == 8 * 35
    assert d.ledger.session_pages() == 0 and d.ledger.counters.session_demotes == 1
    assert run_sync(d.ledger.idle_problems(audit_store=True)) == []
    d.evict_tree()  # the tree keeps nothing of it: everything comes from the host tier
    prompt = np.concatenate([hist, toks(3, 7)])
    g = d.extend(2, prompt, session="s")
    assert (g.cached_len, g.start, g.end) == (35, 35, len(prompt))
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    assert d.port.loads == [(entry.handle, 0, 35)]
    # The entry is gone: the KV is the request's again, owned once.
    assert d.ledger.host.entries == {} and d.port.entries == {}
    assert d.ledger.counters.session_promotes == 1 and d.ledger.counters.promoted_tokens == 35


def demoted_on_a_tree_prefix(d: Driver) -> np.ndarray:
    """A demoted session whose first 32 positions the prefix tree holds (another request
    cached them first); its own 3 positions past them only in its entry."""
    shared = toks(50, 32)
    assert d.extend(90, np.concatenate([shared, toks(51, 1)])) is not None
    d.finish(90, np.concatenate([shared, toks(51, 2)]))  # the tree keeps [0, 32)
    d.ledger.session_max_pages = 0
    d.ledger.open_slot("s")
    _, hist = d.turn(1, np.concatenate([shared, toks(3, 2)]), toks(4, 2), "s")
    assert d.ledger.slots["s"].stored is not None  # 35 positions; its own pages freed
    return hist


def test_a_demoted_sessions_own_pages_are_freed_not_cached():
    d = Driver()
    demoted_session(d)
    assert d.ledger.pool.num_free == d.ledger.pool.num_pages  # nothing went to the tree


def test_a_promotion_takes_the_tree_prefix_and_loads_only_the_rest():
    d = Driver()
    hist = demoted_on_a_tree_prefix(d)
    prompt = np.concatenate([hist, toks(3, 7)])
    g = d.extend(2, prompt, session="s")
    assert (g.cached_len, g.start) == (35, 35)
    assert d.ledger.records[2].cache_protected_len == 32  # shared with the tree, not copied
    assert d.port.loads[-1][1:] == (32, 3)  # positions [32, 35) came from the host tier
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    d.finish(2, np.concatenate([prompt, toks(4, 1)]))


def test_an_edited_history_loads_the_common_prefix_past_the_tree():
    d = Driver()
    hist = demoted_on_a_tree_prefix(d)
    prompt = np.concatenate([hist[:34], toks(9, 12)])  # the client edited the history
    g = d.extend(2, prompt, session="s")
    assert (g.cached_len, g.start) == (34, 34)  # 32 from the tree, 2 loaded
    assert d.port.loads[-1][1:] == (32, 2) and d.ledger.host.entries == {}
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_a_turn_the_entry_adds_nothing_to_drops_it_and_prefills_from_the_tree():
    d = Driver()
    hist = demoted_on_a_tree_prefix(d)
    prompt = np.concatenate([hist[:32], toks(9, 12)])  # diverges where the tree's pages end
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 32 and d.port.loads == []
    assert d.ledger.host.entries == {} and d.port.entries == {}
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_the_tier_keeps_its_budget_dropping_the_least_recently_demoted_first():
    d = Driver(budget=8 * 40)  # one 35-position entry fits, two do not
    a = demoted_session(d, "a", seed=1)
    b = demoted_session(d, "b", seed=2)
    assert d.ledger.slots["a"].stored is None and d.ledger.slots["b"].stored is not None
    assert d.ledger.counters.tier_drops == 1 and d.ledger.host.used == 8 * 35
    d.evict_tree()
    g = d.extend(3, np.concatenate([a, toks(5, 3)]), session="a")
    assert g.cached_len == 0  # "a" lost its KV: it prefills
    g = d.extend(4, np.concatenate([b, toks(6, 3)]), session="b")
    assert g.cached_len == 35


def test_a_failed_load_computes_the_positions_and_a_failed_save_keeps_nothing():
    d = Driver()
    hist = demoted_session(d)
    d.evict_tree()
    d.port.fail = {"load"}
    prompt = np.concatenate([hist, toks(3, 7)])
    g = d.extend(2, prompt, budget=20, session="s")
    assert (g.cached_len, g.start, g.end) == (0, 0, 20)  # within the step's budget
    assert d.ledger.counters.tier_failures == 1 and d.ledger.host.entries == {}
    d.kv.assert_row_holds(g.row, prompt, 20)
    d.port.fail = {"save"}
    d.ledger.open_slot("t")
    d.turn(5, toks(5, 20), toks(6, 2), "t")
    assert d.ledger.slots["t"].stored is None and d.ledger.slots["t"].rec is None
    assert d.ledger.counters.tier_failures == 2


def test_close_and_drop_cache_free_the_entries():
    d = Driver()
    demoted_session(d, "a", seed=1)
    demoted_session(d, "b", seed=2)
    assert len(d.port.entries) == 2
    assert run_sync(d.ledger.close_slots(["a"])) == 0  # no pool page: it held none
    d.check()
    assert list(d.ledger.host.entries) == [d.ledger.slots["b"].stored]
    # drop_cache follows a runner restart: the store went with it; nobody is asked.
    run_sync(d.ledger.drop_cache())
    assert len(d.port.entries) == 1
    d.port.entries.clear()  # the restarted runner's store
    d.check()
    assert d.ledger.host.entries == {} and d.ledger.host.used == 0


def test_a_refused_promotion_keeps_the_entry_for_the_retry():
    d = Driver(num_pages=24)
    hist = demoted_session(d)
    d.evict_tree()
    hog = d.extend(50, toks(50, 80))  # 20 of 24 pages held by a running request
    assert hog is not None
    prompt = np.concatenate([hist, toks(3, 7)])
    assert d.extend(2, prompt, session="s") is None
    assert d.ledger.slots["s"].stored is not None and d.port.loads == []
    run_sync(d.ledger.abort(50))
    d.ledger.forget(50)
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 35
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_pressure_demotes_an_idle_session_and_its_next_turn_loads_it():
    d = Driver(num_pages=24)
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 3), "s")  # 32 positions: 8 pages pinned
    g = d.extend(98, toks(98, 70))  # needs 18 pages, 16 are free: "s" must give its 8
    assert g is not None
    d.finish(98, toks(98, 70))
    assert d.ledger.counters.session_demotes == 1 and d.ledger.slots["s"].stored is not None
    d.evict_tree()
    prompt = np.concatenate([hist, toks(3, 5)])
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 32
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_a_long_session_keeps_its_last_window_of_sliding_kv_and_promotes_whole():
    d = Driver(swa=True)
    d.ledger.session_max_pages = 0
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 10), toks(2, 51), "s")  # 60 positions, window passed most
    slot = d.ledger.slots["s"]
    entry = d.ledger.host.entries[slot.stored]
    # Full layers: every position; sliding layers: the pages of the last window only.
    assert entry.length == 60 and entry.alive.sum() == 4 and entry.alive[-4:].all()
    assert d.ledger.host.used == 8 * (60 + 4 * PS)
    d.evict_tree()
    prompt = np.concatenate([hist, toks(3, 9)])
    g = d.extend(2, prompt, session="s")  # the checker (both pools) runs inside
    assert (g.cached_len, g.start) == (60, 60)
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    d.assert_window_holds(g.row, prompt, 60)
    rec = d.ledger.records[2]
    assert (rec.swa_evict_floor, rec.swa_evicted_seqlen) == (0, 44)
    d.finish(2, np.concatenate([prompt, toks(4, 1)]))
    assert run_sync(d.ledger.idle_problems(audit_store=True)) == []


def test_a_swa_session_diverging_before_its_saved_window_prefills():
    d = Driver(swa=True)
    d.ledger.session_max_pages = 0
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 10), toks(2, 51), "s")
    d.evict_tree()
    prompt = np.concatenate([hist[:30], toks(3, 9)])  # its window at 30 was not saved
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 0 and d.port.loads == []
    d.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_the_checker_names_a_tier_entry_no_session_owns_and_a_store_that_disagrees():
    d = Driver()
    demoted_session(d)
    d.ledger.host.add(TierEntry(999, toks(1, 4), None, 32))
    with pytest.raises(InvariantViolation, match="belong to no session"):
        check_invariants(run_sync(d.ledger.snapshot()))
    d.ledger.host.remove(999)
    # The ledger is the truth: bytes it forgot are freed, entries the store lost dropped.
    (lost,) = d.port.entries
    d.port.entries[12345] = ([], 8)  # a save that outlived its timeout
    del d.port.entries[lost]
    problems = run_sync(d.ledger.idle_problems(audit_store=True))
    assert "forgotten entries [12345]; freed" in problems[0], problems
    assert f"lost entries [{lost}]; dropped" in problems[1], problems
    assert d.port.entries == {} and d.ledger.host.entries == {} and d.ledger.host.used == 0
    assert d.ledger.slots["s"].stored is None
    assert run_sync(d.ledger.idle_problems(audit_store=True)) == []


def test_an_offload_hint_moves_an_idle_session_out_of_the_pool_at_once():
    d = Driver()
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 6), "s")
    free = d.ledger.pool.num_free
    assert run_sync(d.ledger.offload_slot("s")) == (9, 35)  # 9 pages freed, 35 stored
    d.check()
    # Freed, not cached: nothing of it waits in the tree, the pool has the pages back.
    assert d.ledger.pool.num_free == free + 9 and d.ledger.session_pages() == 0
    assert d.ledger.slot_tokens("s") == 35
    assert run_sync(d.ledger.offload_slot("s")) == (0, 0)  # nothing left to move
    prompt = np.concatenate([hist, toks(3, 4)])
    g = d.extend(2, prompt, session="s")
    assert (g.cached_len, d.port.loads[-1][1:]) == (35, (0, 35))
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    assert run_sync(d.ledger.offload_slot("s")) == (0, 0)  # a running turn is not moved


def test_without_a_host_tier_an_offload_releases_to_the_prefix_tree():
    d = Driver()
    d.ledger.tiers = d.ledger.host = None
    d.ledger.open_slot("s")
    _, hist = d.turn(1, toks(1, 30), toks(2, 6), "s")
    assert run_sync(d.ledger.offload_slot("s")) == (9, 0)
    d.check()
    g = d.extend(2, np.concatenate([hist, toks(3, 4)]), session="s")
    assert g.cached_len == 32  # the tree's whole pages


def with_disk(d: Driver, host_budget: int, disk_budget: int = 1 << 20) -> Driver:
    d.ledger.host = KvTier("host", host_budget)
    d.ledger.disk = KvTier("disk", disk_budget)
    return d


def both_promote(d: Driver, a: np.ndarray, b: np.ndarray) -> None:
    """Sessions "a" (its entry on disk) and "b" (in the host tier) each load their whole
    history back, with the tree holding none of it."""
    d.evict_tree()
    for rid, sid, hist in ((3, "a", a), (4, "b", b)):
        prompt = np.concatenate([hist, toks(rid, 3)])
        g = d.extend(rid, prompt, session=sid)
        assert g.cached_len == 35
        d.kv.assert_row_holds(g.row, prompt, len(prompt))
    assert d.ledger.counters.disk_promotes == 1 and d.ledger.stored_tokens() == 0


def test_the_host_tier_overflows_to_the_disk_tier_and_both_promote():
    d = with_disk(Driver(), host_budget=8 * 40)  # one 35-position entry fits in the host
    a = demoted_session(d, "a", seed=1)
    b = demoted_session(d, "b", seed=2)
    ha, hb = d.ledger.slots["a"].stored, d.ledger.slots["b"].stored
    assert list(d.ledger.disk.entries) == [ha] and list(d.ledger.host.entries) == [hb]
    assert d.port.on_disk == {ha} and d.ledger.disk.used == 8 * 35 // 2  # the file's size
    assert d.ledger.counters.tier_spills == 1 and d.ledger.counters.tier_drops == 0
    both_promote(d, a, b)


def test_the_disk_tier_drops_its_least_recent_past_its_budget_and_a_failed_spill_drops():
    d = with_disk(Driver(), host_budget=8 * 40, disk_budget=8 * 35 // 2)
    demoted_session(d, "a", seed=1)
    demoted_session(d, "b", seed=2)  # "a" spilled to disk
    demoted_session(d, "c", seed=3)  # "b" spilled: the disk holds one, "a" is dropped
    assert d.ledger.slots["a"].stored is None
    assert d.ledger.slots["b"].stored in d.ledger.disk.entries
    assert d.ledger.slots["c"].stored in d.ledger.host.entries
    assert d.ledger.counters.tier_drops == 1
    d.port.fail = {"spill"}
    demoted_session(d, "e", seed=4)  # "c" cannot be written: dropped instead
    assert d.ledger.slots["c"].stored is None and d.ledger.counters.tier_failures == 1
    run_sync(d.ledger.drop_cache())
    d.port.entries.clear()  # the restarted runner's store
    d.check()
    assert d.ledger.stored_tokens() == 0


def test_a_drain_persists_idle_sessions_to_disk_and_a_new_ledger_takes_them_back():
    d = with_disk(Driver(), host_budget=1 << 20)
    d.ledger.open_slot("kept")
    _, hist = d.turn(1, toks(1, 30), toks(2, 6), "kept")  # in the pool
    demoted_session(d, "stored", seed=3)  # in the host tier
    d.ledger.open_slot("busy")
    d.extend(9, toks(9, 10), session="busy")  # a turn runs: not persisted
    kept = run_sync(d.ledger.persist_sessions(["kept", "stored", "busy", "gone"]))
    d.check()
    assert [sid for sid, _ in kept] == ["kept", "stored"]
    assert d.ledger.host.entries == {} and len(d.ledger.disk.entries) == 2
    assert d.ledger.slots["kept"].rec is None and d.ledger.session_pages() == 0
    # The next run: a fresh ledger (and the same store) takes the entries back.
    fresh = with_disk(Driver(), host_budget=1 << 20, disk_budget=150)  # one 140-byte file
    fresh.kv, fresh.port = d.kv, d.port
    fresh.ledger.tiers = d.port
    moved = [(sid, TierEntry(e.handle, e.tokens, e.alive, e.nbytes)) for sid, e in kept]
    refused = fresh.ledger.restore_sessions(moved)
    assert refused == [kept[1][1].handle]  # over the smaller disk budget
    run_sync(fresh.port.drop(refused))
    fresh.check()
    assert fresh.ledger.slots["kept"].stored == kept[0][1].handle
    assert next(fresh.ledger._handles) > max(e.handle for _, e in kept)
    prompt = np.concatenate([hist, toks(4, 3)])
    g = fresh.extend(5, prompt, session="kept")
    assert g.cached_len == 35 and fresh.ledger.counters.disk_promotes == 1
    fresh.kv.assert_row_holds(g.row, prompt, len(prompt))


def test_a_refused_turn_keeps_an_entry_it_cannot_use_and_a_granted_one_drops_it():
    d = Driver(num_pages=24)
    hist = demoted_session(d)  # the tree holds its 8 whole pages
    hog = d.extend(50, toks(50, 60))  # 15 of the pool's 24 pages: the rest are the tree's
    assert hog is not None
    prompt = np.concatenate([hist[:8], toks(9, 60)])  # the entry adds nothing past the tree
    assert d.extend(2, prompt, session="s") is None  # refused: no pages
    assert d.ledger.slots["s"].stored is not None  # kept for the retry
    run_sync(d.ledger.abort(50))
    d.ledger.forget(50)
    g = d.extend(2, prompt, session="s")
    assert g.cached_len == 8 and d.ledger.slots["s"].stored is None and d.port.entries == {}


class Writes:
    """The allocator's two-phase spill, driven by hand: the ledger starts files (`started`),
    the test ends them, the store's part (`write`) and the ledger's (`done`) apart."""

    def __init__(self, d: Driver) -> None:
        self.d = d
        self.started: list[int] = []
        d.ledger.spill_later = self.started.append

    def write(self, handle: int) -> int:
        return run_sync(self.d.port.spill(handle))

    def done(self, handle: int, nbytes: int | None) -> None:
        run_sync(self.d.ledger.spill_done(handle, nbytes))
        self.d.check()


def a_writing(host_budget: int = 8 * 40, disk_budget: int = 1 << 20):
    """Sessions "a" and "b" demoted into a host tier that holds one of them: "a" moved to
    the disk tier, its file being written. (driver, writes, a's history, b's history)."""
    d = with_disk(Driver(), host_budget, disk_budget)
    writes = Writes(d)
    a = demoted_session(d, "a", seed=1)
    b = demoted_session(d, "b", seed=2)
    return d, writes, a, b


def test_a_spill_moves_the_entry_to_disk_at_once_and_its_file_follows():
    d, writes, a, b = a_writing()
    ha, hb = d.ledger.slots["a"].stored, d.ledger.slots["b"].stored
    # The ledger moved "a" without waiting: its bytes are still the store's host copy.
    assert writes.started == [ha] and d.ledger.writing == {ha: 8 * 35}
    assert list(d.ledger.disk.entries) == [ha] and list(d.ledger.host.entries) == [hb]
    assert d.ledger.disk.used == 8 * 35 and d.port.on_disk == set()
    assert d.ledger.counters.tier_spills == 0
    d.check()  # the audit takes the host copy for the entry being written
    nbytes = writes.write(ha)
    d.check()  # ... and the file, before the ledger hears of it
    writes.done(ha, nbytes)
    assert d.ledger.writing == {} and d.ledger.disk.used == 8 * 35 // 2
    assert d.ledger.counters.tier_spills == 1
    writes.done(ha, nbytes)  # told twice: nothing changes
    assert d.ledger.disk.used == 8 * 35 // 2 and d.ledger.counters.tier_spills == 1
    both_promote(d, a, b)


def test_a_turn_loads_an_entry_whose_file_is_being_written_from_memory():
    d, writes, a, _ = a_writing()
    ha = d.ledger.slots["a"].stored
    assert d.ledger.spilled_entry("a") is None  # no read-ahead: the bytes are in memory
    d.evict_tree()
    prompt = np.concatenate([a, toks(3, 3)])
    g = d.extend(3, prompt, session="a")
    assert g.cached_len == 35 and d.ledger.counters.disk_promotes == 0
    d.kv.assert_row_holds(g.row, prompt, len(prompt))
    assert d.ledger.writing == {} and ha not in d.port.entries
    writes.done(ha, None)  # the store found the entry dropped: no failure, nothing moves
    assert d.ledger.counters.tier_failures == 0 and d.ledger.counters.tier_drops == 0


def test_a_failed_write_drops_the_entry_and_the_session_prefills():
    d, writes, a, _ = a_writing()
    ha = d.ledger.slots["a"].stored
    writes.done(ha, None)  # disk full
    assert d.ledger.slots["a"].stored is None and ha not in d.port.entries
    assert d.ledger.counters.tier_failures == 1 and d.ledger.disk.used == 0
    d.evict_tree()
    g = d.extend(3, np.concatenate([a, toks(3, 3)]), session="a")
    assert g.cached_len == 0


def test_a_file_larger_than_its_host_copy_fits_the_disk_budget_again():
    d, writes, _, _ = a_writing(disk_budget=8 * 35)
    ha = d.ledger.slots["a"].stored
    writes.write(ha)
    writes.done(ha, 8 * 35 + 100)  # the file's header: over the disk's budget
    assert d.ledger.slots["a"].stored is None and d.ledger.disk.used == 0
    assert d.ledger.counters.tier_drops == 1


def test_files_being_written_hold_at_most_the_host_budget_past_the_first():
    d, writes, _, _ = a_writing()  # "a" is written beside
    demoted_session(d, "c", seed=3)  # "b" would make 2 x 280 bytes in flight: it waits
    ha, hb = d.ledger.slots["a"].stored, d.ledger.slots["b"].stored
    assert writes.started == [ha] and d.ledger.writing == {ha: 8 * 35}
    assert hb in d.port.on_disk and hb in d.ledger.disk.entries
    assert d.ledger.counters.tier_spills == 1
    d.check()


def test_a_drain_waits_for_the_files_being_written():
    d, writes, _, _ = a_writing()
    ha = d.ledger.slots["a"].stored
    kept = run_sync(d.ledger.persist_sessions(["a", "b"]))
    assert sorted(sid for sid, _ in kept) == ["a", "b"] and d.ledger.writing == {}
    assert {e.handle for _, e in kept} <= d.port.on_disk  # the manifest names only files
    d.check()
    writes.done(ha, 8 * 35 // 2)  # the write's own end comes late: nothing changes
    assert d.ledger.counters.tier_spills == 2
    d.ledger.writing[ha + 1000] = 8  # a write for no entry: the check names it
    assert any(str(ha + 1000) in p for p in d.problems())
