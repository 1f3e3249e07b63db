"""Property tests: random operation sequences against the allocator's ledger.

Every step runs the invariant checker, and a fake KV store checks that the
slots a request's row points at really hold that request's tokens at those
positions (so prefix matches return the right KV, and no freed slot is reused
while still referenced).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.allocator.ledger import LedgerError
from tests.unit.ledger_driver import FakeKv, make_ledger, run_sync

BASES = [list(range(100, 140)), list(range(200, 230)), [100, 101, 102, 103, 300, 301]]


class LedgerMachine(RuleBasedStateMachine):
    page_size = 1

    @initialize(
        num_pages=st.integers(6, 80),
        rows=st.integers(1, 8),
        radix=st.booleans(),
    )
    def setup(self, num_pages, rows, radix):
        self.capacity = 64
        self.ledger, self.tree = make_ledger(
            num_pages, self.page_size, rows, self.capacity, radix=radix
        )
        self.kv = FakeKv(self.ledger.pool.num_slots)
        self.tokens: dict[int, np.ndarray] = {}  # live requests' known tokens
        self.next_rid = 0

    # -- helpers --
    def _apply(self, deltas):
        self.kv.apply(deltas, self.capacity)

    def _held(self):
        return [
            r for r in self.tokens if self.ledger.records.get(r) and self.ledger.records[r].is_held
        ]

    def _prefilling(self):
        return [
            r for r in self._held() if self.ledger.records[r].kv_committed_len < len(self.tokens[r])
        ]

    def _decoding(self):
        return [
            r
            for r in self._held()
            if self.ledger.records[r].kv_committed_len == len(self.tokens[r])
        ]

    # -- rules --
    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 50), max_size=12),
    )
    def new_request(self, base, cut, suffix):
        toks = np.array(base[:cut] + suffix, dtype=np.int64)
        if len(toks) < 1:
            toks = np.array([7], dtype=np.int64)
        self.tokens[self.next_rid] = toks
        self.next_rid += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), budget=st.integers(1, 24))
    def extend(self, data, budget):
        waiting = [
            r
            for r in self.tokens
            if not self.ledger.record(r).is_held
            or self.ledger.records[r].kv_committed_len < len(self.tokens[r])
        ]
        if not waiting:
            return
        rid = data.draw(st.sampled_from(waiting))
        toks = self.tokens[rid]
        deltas = []
        grant = run_sync(self.ledger.alloc_extend(rid, toks, budget, deltas))
        self._apply(deltas)
        if grant is None:
            assert deltas == []
            return
        if grant.cached_len:
            self.kv.assert_row_holds(grant.row, toks, grant.cached_len)
        self.kv.write(grant.row, toks, grant.start, grant.end)
        self.kv.assert_row_holds(grant.row, toks, grant.end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), budget=st.integers(4, 64))
    def prefill_to_end(self, data, budget):
        """Run one request's chunks until its prompt is in KV (or the pool refuses)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        for _ in range(64):
            rec = self.ledger.record(rid)
            if rec.is_held and rec.kv_committed_len == len(self.tokens[rid]):
                return
            toks = self.tokens[rid]
            deltas = []
            grant = run_sync(self.ledger.alloc_extend(rid, toks, budget, deltas))
            self._apply(deltas)
            if grant is None:
                return
            self.kv.write(grant.row, toks, grant.start, grant.end)
            if grant.end < len(toks):
                deltas = []
                run_sync(self.ledger.cache_unfinished(rid, toks, deltas))
                self._apply(deltas)
            self.kv.assert_row_holds(grant.row, toks, grant.end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_unfinished(self, data):
        cands = self._prefilling()
        if cands:
            rid = data.draw(st.sampled_from(cands))
            deltas = []
            run_sync(self.ledger.cache_unfinished(rid, self.tokens[rid], deltas))
            self._apply(deltas)
            rec = self.ledger.records[rid]
            self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len)

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
            assert deltas == []
            return
        self._apply(deltas)
        for rid in rids:
            rec = self.ledger.records[rid]
            self.tokens[rid] = np.append(self.tokens[rid], new_token)
            self.kv.write(
                rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len - 1, rec.kv_committed_len
            )
            self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), kind=st.sampled_from(["finish", "abort", "retract"]))
    def release(self, data, kind):
        cands = self._decoding() if kind == "finish" else self._held()
        if not cands:
            return
        rid = data.draw(st.sampled_from(cands))
        toks = self.tokens[rid]
        if kind == "finish":
            run_sync(self.ledger.finish(rid, toks))
        elif kind == "abort":
            run_sync(self.ledger.abort(rid))
            run_sync(self.ledger.abort(rid))  # idempotent
        else:
            # Only committed KV may be cached: retract keeps the request's tokens.
            run_sync(self.ledger.retract(rid, toks))
        rec = self.ledger.records[rid]
        assert not rec.is_held and rec.is_released
        if kind != "retract":
            self.ledger.forget(rid)
            del self.tokens[rid]

    @precondition(lambda self: self.tree is not None)
    @rule(n=st.integers(1, 8))
    def evict(self, n):
        freed = self.tree.evict(n)
        self.ledger.pool.free(freed)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "ledger"):
            run_sync(self.ledger.check())

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        for rid in list(self.tokens):
            run_sync(self.ledger.abort(rid))
            self.ledger.forget(rid)
        run_sync(self.ledger.check())
        tree_pages = 0 if self.tree is None else len(self.tree.owned_pages())
        assert self.ledger.pool.num_free + tree_pages == self.ledger.pool.num_pages
        if self.tree is not None:
            assert self.tree.protected_size == 0, "a lock leaked"


class LedgerMachinePage16(LedgerMachine):
    page_size = 16


_settings = settings(
    max_examples=120,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLedgerPage1 = LedgerMachine.TestCase
TestLedgerPage1.settings = _settings
TestLedgerPage16 = LedgerMachinePage16.TestCase
TestLedgerPage16.settings = _settings


def test_context_overflow_is_a_clear_error_and_changes_nothing():
    ledger, _ = make_ledger(8, 1, 2, capacity=4)
    with pytest.raises(LedgerError, match="exceed row capacity"):
        run_sync(ledger.alloc_extend(1, np.arange(5), 8, []))
    run_sync(ledger.check())
    assert ledger.pool.num_free == 8


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
        run_sync(
            ledger.alloc_extend(rid, np.array([rid, 5, 6, 7]), 8, [])
        )  # 2 pages each? no: 3 pages total
    # Pool had 3 pages: request 1 took 2, request 2 could not be admitted.
    held = [r for r in (1, 2) if ledger.records[r].is_held]
    assert held == [1]
    before = ledger.pool.num_free
    short = run_sync(ledger.alloc_decode([1], []))
    assert short == 0 and ledger.pool.num_free == before - 1
    short = run_sync(ledger.alloc_decode([1], []))  # position 5 fits the open page
    assert short == 0
    assert run_sync(ledger.alloc_decode([1], [])) == 1  # position 6 needs a 4th page
    assert ledger.records[1].kv_allocated_len == 6
    run_sync(ledger.check())
