"""Property tests: random operation sequences against the allocator's ledger.

After every step the invariant checker runs, and a fake KV store checks that the slots a
request's row points at really hold that request's tokens at those positions (so prefix
matches return the right KV, and no freed slot is reused while still referenced). The
rules build shared prefixes on purpose (twins prefilling the same prompt in chunks,
re-submitted finished prompts, a pool filled with cached pages) so that every path of the
ledger is reached; `event` counts them. Oracles beyond the checker:

* a request holds a record exactly while it holds KV or waits after a retraction;
* an admission is granted whenever free + evictable pages and a row suffice, computes at
  least one token, and a refusal leaves the pool and the tree as they were;
* speculative steps: a reservation moves kv_allocated_len by 1 + k and leaves
  kv_committed_len; the commit keeps exactly the accepted positions' KV, frees exactly the
  rejected tail's whole pages, and a finish or retraction between the two is refused,
  changing nothing (an abort frees everything).

`MUTANTS` plants one bug each in a copy of the ledger's source; the same machine, at the
same settings, must catch every one of them (tests/unit/test_ledger_mutants.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.allocator.ledger import KvLedger, LedgerError
from kvcore import ceil_page
from tests.unit.ledger_driver import FakeKv, RequestViews, make_ledger, run_sync

BASES = [list(range(100, 140)), list(range(200, 230)), [100, 101, 102, 103, 300, 301]]


class LedgerMachine(RequestViews, RuleBasedStateMachine):
    page_size = 1
    ledger_class: type = KvLedger

    @initialize(
        num_pages=st.integers(6, 80),
        rows=st.integers(1, 8),
        radix=st.booleans(),
    )
    def setup(self, num_pages, rows, radix):
        self.capacity = 64
        self.ledger, self.tree = make_ledger(
            num_pages, self.page_size, rows, self.capacity, radix=radix, cls=self.ledger_class
        )
        self.kv = FakeKv(self.ledger.pool.num_slots)
        self.tokens: dict[int, np.ndarray] = {}  # live requests' known tokens
        self.retracted: set[int] = set()  # released by retraction, waiting to come back
        self.finished: list[np.ndarray] = []  # tokens of finished requests (cached prefixes)
        self.next_rid = 0
        self.duplicates_freed = 0
        self.drafting: dict[int, np.ndarray] = {}  # rid -> tokens written in its reserved slots

    # -- helpers --
    def _apply(self, deltas):
        self.kv.apply(deltas, self.capacity)

    def _add(self, toks) -> int:
        rid = self.next_rid
        self.next_rid += 1
        self.tokens[rid] = np.asarray(toks, dtype=np.int64)
        return rid

    def _pool_and_tree(self):
        tree = None
        if self.tree is not None:
            tree = (
                sorted(self.tree.owned_slots().tolist()),
                self.tree.evictable_size,
                self.tree.protected_size,
            )
        return sorted(self.ledger.pool.free_pages().tolist()), tree

    def _would_fit(self, rid, budget) -> bool:
        """Whether free + evictable pages (after locking the match) and a row cover the next
        chunk of `rid`; computed from the pool and the tree, not from the ledger."""
        toks, rec, ps = self.tokens[rid], self._rec(rid), self.page_size
        if rec is not None and rec.is_held:
            start, open_page = rec.kv_committed_len, start_in_open_page(rec.kv_allocated_len, ps)
            evictable = self.tree.evictable_size if self.tree is not None else 0
        else:
            if self.ledger.table.num_free_rows == 0:
                return False
            start, open_page, evictable = 0, 0, 0
            if self.tree is not None:
                start = self.tree.match_prefix(toks[: len(toks) - 1]).length
                evictable = self.tree.evictable_size - _unlocked_on_path(self.tree, toks, start)
        end = min(len(toks), start + budget)
        fresh = max(end - start - open_page, 0)
        need = ceil_page(fresh, ps) // ps
        return need <= self.ledger.pool.num_free + evictable // ps

    def _extend(self, rid, budget):
        """One alloc_extend with every oracle; the grant or None."""
        toks = self.tokens[rid]
        fits = self._would_fit(rid, budget)
        before = self._pool_and_tree()
        had_record = self._rec(rid) is not None
        deltas = []
        grant = run_sync(self.ledger.alloc_extend(rid, toks, budget, deltas))
        self._apply(deltas)
        if grant is None:
            event("extend refused")
            assert not fits, f"request {rid} refused although free + evictable pages suffice"
            assert deltas == []
            assert self._pool_and_tree() == before, "a refusal changed the pool or the tree"
            assert (self._rec(rid) is not None) == had_record, "a refusal created a record"
            return None
        assert grant.end > grant.start, f"request {rid}: a grant that computes no token"
        if grant.cached_len:
            event("extend hit the prefix cache")
            self.kv.assert_row_holds(grant.row, toks, grant.cached_len)
        self.kv.write(grant.row, toks, grant.start, grant.end)
        self.kv.assert_row_holds(grant.row, toks, grant.end)
        self.retracted.discard(rid)
        return grant

    def _cache_unfinished(self, rid):
        rec = self._rec(rid)
        free_before = self.ledger.pool.num_free
        deltas = []
        run_sync(self.ledger.cache_unfinished(rid, self.tokens[rid], deltas))
        self._apply(deltas)
        if self.ledger.pool.num_free > free_before:
            event("cache_unfinished freed duplicate pages")
            self.duplicates_freed += self.ledger.pool.num_free - free_before
        self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len)

    # -- rules --
    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 50), max_size=12),
    )
    def new_request(self, base, cut, suffix):
        toks = base[:cut] + suffix
        self._add(toks or [7])

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 50), max_size=3))
    def resubmit_finished(self, data, extra):
        """A finished prompt again, cut to whole pages (fully cached) or extended."""
        toks = data.draw(st.sampled_from(self.finished))
        whole = (len(toks) // self.page_size) * self.page_size
        self._add(list(toks[: max(whole, 1)]) + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), budget=st.integers(1, 24))
    def extend(self, data, budget):
        waiting = self._not_done()
        if waiting:
            self._extend(data.draw(st.sampled_from(waiting)), budget)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), budget=st.integers(4, 64))
    def prefill_to_end(self, data, budget):
        """Run one request's chunks until its prompt is in KV (or the pool refuses)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        for _ in range(64):
            rec = self._rec(rid)
            if rec is not None and rec.is_held and rec.kv_committed_len == len(self.tokens[rid]):
                return
            grant = self._extend(rid, budget)
            if grant is None:
                return
            if grant.end < len(self.tokens[rid]):
                self._cache_unfinished(rid)

    @rule(base=st.sampled_from(BASES), chunk=st.sampled_from([1, 2, 4, 8, 16]))
    def twins_prefill_in_chunks(self, base, chunk):
        """Two requests with one prompt prefill side by side in chunks, each caching its
        finished pages: the second finds the first's pages and frees its duplicates."""
        a, b = self._add(base), self._add(base)
        for _ in range(len(base)):
            progressed = False
            for rid in (a, b):
                rec = self._rec(rid)
                if rec is not None and rec.is_held and rec.kv_committed_len == len(base):
                    continue
                grant = self._extend(rid, chunk)
                if grant is not None:
                    progressed = True
                    if grant.end < len(base):
                        self._cache_unfinished(rid)
            if not progressed:
                return

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_unfinished(self, data):
        cands = self._prefilling()
        if cands:
            self._cache_unfinished(data.draw(st.sampled_from(cands)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_token=st.integers(0, 50))
    def decode(self, data, new_token):
        cands = [r for r in self._decoding() if len(self.tokens[r]) < self.capacity]
        if not cands:
            return
        rids = data.draw(st.lists(st.sampled_from(cands), min_size=1, unique=True))
        deltas = []
        short = run_sync(self.ledger.alloc_decode(rids, deltas))
        if short:
            event("decode short")
            assert deltas == []
            return
        self._apply(deltas)
        for rid in rids:
            rec = self._rec(rid)
            self.tokens[rid] = np.append(self.tokens[rid], new_token)
            self.kv.write(
                rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len - 1, rec.kv_committed_len
            )
            self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def speculate(self, data):
        """A decode step with draft tokens: 1 + k slots reserved per request (k may be 0:
        that request commits at once), KV written in all of them."""
        cands = [r for r in self._decoding() if len(self.tokens[r]) < self.capacity]
        if not cands:
            return
        rids = data.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=3, unique=True))
        drafts = [
            data.draw(st.integers(0, min(6, self.capacity - len(self.tokens[r]) - 1))) for r in rids
        ]
        before = self._pool_and_tree()
        lengths = [(self._rec(r).kv_committed_len, self._rec(r).kv_allocated_len) for r in rids]
        deltas = []
        short = run_sync(self.ledger.alloc_decode(rids, deltas, drafts))
        if short:
            event("speculative decode short")
            assert deltas == [] and self._pool_and_tree() == before
            assert lengths == [
                (self._rec(r).kv_committed_len, self._rec(r).kv_allocated_len) for r in rids
            ]
            return
        self._apply(deltas)
        for rid, k, (committed, allocated) in zip(rids, drafts, lengths):
            rec = self._rec(rid)
            step = data.draw(st.lists(st.integers(0, 50), min_size=1 + k, max_size=1 + k))
            assert rec.kv_allocated_len == allocated + 1 + k
            if k == 0:
                assert rec.kv_committed_len == committed + 1  # allocation commits
                self.tokens[rid] = np.append(self.tokens[rid], step)
                self.kv.write(rec.req_pool_idx, self.tokens[rid], committed, committed + 1)
                continue
            event("draft slots reserved")
            assert rec.kv_committed_len == committed, "a reservation committed"
            candidate = np.append(self.tokens[rid], step)
            self.kv.write(rec.req_pool_idx, candidate, committed, committed + 1 + k)
            self.drafting[rid] = candidate

    @precondition(lambda self: self.drafting)
    @rule(data=st.data())
    def commit_draft(self, data):
        rid = data.draw(st.sampled_from(sorted(self.drafting)))
        rec, ps = self._rec(rid), self.page_size
        committed, allocated = rec.kv_committed_len, rec.kv_allocated_len
        accepted = data.draw(st.integers(1, allocated - committed))
        free_before = self.ledger.pool.num_free
        run_sync(self.ledger.commit_draft(rid, accepted))
        candidate = self.drafting.pop(rid)
        self.tokens[rid] = candidate[: committed + accepted]
        end = committed + accepted
        assert rec.kv_committed_len == rec.kv_allocated_len == end
        freed = ceil_page(allocated, ps) // ps - ceil_page(end, ps) // ps
        assert self.ledger.pool.num_free - free_before == freed, "the rejected tail's pages"
        if freed:
            event("rejected draft pages freed")
        self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], end)
        with pytest.raises(LedgerError, match="no draft slots"):
            run_sync(self.ledger.commit_draft(rid, 1))

    @precondition(lambda self: self.drafting)
    @rule(data=st.data(), kind=st.sampled_from(["finish", "abort", "retract"]))
    def release_mid_step(self, data, kind):
        """Between a reservation and its commit only an abort may release the record."""
        rid = data.draw(st.sampled_from(sorted(self.drafting)))
        toks = self.tokens[rid]
        if kind == "abort":
            event("abort mid speculative step")
            run_sync(self.ledger.abort(rid))
            self.ledger.forget(rid)
            del self.tokens[rid], self.drafting[rid]
            return
        before = self._pool_and_tree()
        rec = self._rec(rid)
        lengths = (rec.kv_committed_len, rec.kv_allocated_len)
        with pytest.raises(LedgerError, match="not committed"):
            if kind == "finish":
                run_sync(self.ledger.finish(rid, toks))
            else:
                run_sync(self.ledger.retract(rid, toks))
        assert self._pool_and_tree() == before and rec.is_held
        assert (rec.kv_committed_len, rec.kv_allocated_len) == lengths
        with pytest.raises(LedgerError, match="not committed"):
            run_sync(self.ledger.alloc_decode([rid], []))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), kind=st.sampled_from(["finish", "abort", "retract"]))
    def release(self, data, kind):
        cands = self._decoding() if kind == "finish" else self._held()
        cands = [r for r in cands if r not in self.drafting]
        if not cands:
            return
        rid = data.draw(st.sampled_from(cands))
        toks = self.tokens[rid]
        if kind == "finish":
            run_sync(self.ledger.finish(rid, toks))
            self.finished.append(toks)
        elif kind == "abort":
            run_sync(self.ledger.abort(rid))
            run_sync(self.ledger.abort(rid))  # idempotent
        else:
            # Only committed KV may be cached: retract keeps the request's tokens.
            run_sync(self.ledger.retract(rid, toks))
            self.retracted.add(rid)
        rec = self._rec(rid)
        assert not rec.is_held and rec.is_released
        if kind != "retract":
            self.ledger.forget(rid)
            del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def forget_refuses_a_held_record(self, data):
        held = self._held()
        if not held:
            return
        rid = data.draw(st.sampled_from(held))
        with pytest.raises(LedgerError, match="still holds"):
            self.ledger.forget(rid)

    @precondition(lambda self: self.tree is not None)
    @rule(data=st.data())
    def fill_the_pool_with_cached_pages(self, data):
        """Finish requests until the pool is full of tree pages: admission must evict."""
        for _ in range(8):
            base = data.draw(st.sampled_from(BASES))
            rid = self._add([*base, self.next_rid % 50])
            grant = self._extend(rid, 64)
            if grant is None:
                del self.tokens[rid]
                return
            if grant.end < len(self.tokens[rid]):
                run_sync(self.ledger.abort(rid))
            else:
                run_sync(self.ledger.finish(rid, self.tokens[rid]))
                self.finished.append(self.tokens[rid])
            self.ledger.forget(rid)
            del self.tokens[rid]

    @precondition(lambda self: self.tree is not None)
    @rule(n=st.integers(1, 8))
    def evict(self, n):
        freed = self.tree.evict(n)
        self.ledger.pool.free(freed)

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "ledger"):
            return
        run_sync(self.ledger.check())
        for rid, rec in self.ledger.records.items():
            if rec.is_held and rid not in self.drafting:
                assert rec.kv_committed_len == rec.kv_allocated_len, f"request {rid} not at rest"
        holding = {r for r in self.tokens if self._rec(r) is not None and self._rec(r).is_held}
        assert set(self.ledger.records) == holding | self.retracted, (
            f"records {sorted(self.ledger.records)} but requests holding KV or retracted "
            f"{sorted(holding | self.retracted)}"
        )

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        target(float(self.duplicates_freed), label="duplicate pages freed")
        self.drafting.clear()
        for rid in list(self.tokens):
            run_sync(self.ledger.abort(rid))
            self.ledger.forget(rid)
        run_sync(self.ledger.check())
        assert not self.ledger.records, f"records left: {sorted(self.ledger.records)}"
        tree_pages = 0 if self.tree is None else len(self.tree.owned_pages())
        assert self.ledger.pool.num_free + tree_pages == self.ledger.pool.num_pages
        if self.tree is not None:
            assert self.tree.protected_size == 0, "a lock leaked"


def start_in_open_page(allocated: int, page_size: int) -> int:
    """Positions still free in the last, partly used page of a row."""
    return (-allocated) % page_size


def _unlocked_on_path(tree, tokens, length: int) -> int:
    """Tokens on the tree path of `tokens[:length]` in nodes nobody locks (they become
    protected when an admission locks the match)."""
    node, pos, total = tree._root, 0, 0
    while pos < length:
        child = node.children[tree._child_key(tokens, pos)]
        if child.lock_ref == 0:
            total += len(child.key)
        pos += len(child.key)
        node = child
    return total


class LedgerMachinePage16(LedgerMachine):
    page_size = 16


class LedgerMachinePage4(LedgerMachine):
    page_size = 4


SETTINGS = settings(
    max_examples=120,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLedgerPage1 = LedgerMachine.TestCase
TestLedgerPage1.settings = SETTINGS
TestLedgerPage4 = LedgerMachinePage4.TestCase
TestLedgerPage4.settings = SETTINGS
TestLedgerPage16 = LedgerMachinePage16.TestCase
TestLedgerPage16.settings = SETTINGS


def test_context_overflow_is_a_clear_error_and_changes_nothing():
    ledger, _ = make_ledger(8, 1, 2, capacity=4)
    with pytest.raises(LedgerError, match="exceed row capacity"):
        run_sync(ledger.alloc_extend(1, np.arange(5), 8, []))
    run_sync(ledger.check())
    assert ledger.pool.num_free == 8 and not ledger.records


def test_prefix_reuse_prefills_only_new_tokens():
    ledger, tree = make_ledger(64, 4, 4, capacity=64)
    a = np.arange(1, 30)
    deltas = []
    g = run_sync(ledger.alloc_extend(1, a, 64, deltas))
    assert (g.cached_len, g.start, g.end) == (0, 0, 29)
    run_sync(ledger.finish(1, a))
    ledger.forget(1)
    b = np.concatenate([a[:24], [999, 998]])
    g2 = run_sync(ledger.alloc_extend(2, b, 64, []))
    assert g2.cached_len == 24 and g2.start == 24 and g2.end == 26
    assert ledger.counters.cache_hit_tokens == 24
    run_sync(ledger.check())


def test_decode_is_all_or_nothing_and_reports_shortfall():
    ledger, tree = make_ledger(3, 2, 4, capacity=16)
    for rid in (1, 2):
        run_sync(ledger.alloc_extend(rid, np.array([rid, 5, 6, 7]), 8, []))
    # Pool had 3 pages: request 1 took 2, request 2 could not be admitted (and holds no record).
    assert ledger.records[1].is_held and 2 not in ledger.records
    before = ledger.pool.num_free
    short = run_sync(ledger.alloc_decode([1], []))
    assert short == 0 and ledger.pool.num_free == before - 1
    short = run_sync(ledger.alloc_decode([1], []))  # position 5 fits the open page
    assert short == 0
    assert run_sync(ledger.alloc_decode([1], [])) == 1  # position 6 needs a 4th page
    assert ledger.records[1].kv_allocated_len == 6
    with pytest.raises(LedgerError, match="twice"):
        run_sync(ledger.alloc_decode([1, 1], []))
    run_sync(ledger.check())


def test_draft_slots_take_free_pages_only_never_cached_kv():
    """A speculative reservation is a guess: it neither evicts the prefix tree nor takes an
    idle session's pages; short of free pages it is refused and plain decode evicts."""
    ledger, tree = make_ledger(6, 4, 4, capacity=64)
    cached = np.arange(100, 116)
    run_sync(ledger.alloc_extend(1, cached, 64, []))
    run_sync(ledger.finish(1, cached))  # 4 pages cached, evictable
    ledger.forget(1)
    mine = np.arange(200, 208)
    run_sync(ledger.alloc_extend(2, mine, 64, []))  # the last 2 pages
    assert ledger.pool.num_free == 0 and tree.evictable_size == 16
    short = run_sync(ledger.alloc_decode([2], [], [3]))
    assert short == 1 and tree.evictable_size == 16  # refused, nothing evicted
    assert ledger.records[2].kv_allocated_len == 8
    assert run_sync(ledger.alloc_decode([2], [])) == 0  # plain decode may evict
    assert tree.evictable_size < 16
    run_sync(ledger.check())
