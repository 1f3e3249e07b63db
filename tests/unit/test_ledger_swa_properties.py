"""Property tests: sliding-window pools, streaming sessions and the prefix tree together.

A random sequence of engine operations runs against a ledger with a sliding pool (or, in
one setup of four, without), the prefix tree and session slots, at page sizes 1 and 16,
with `swa_free_prompt` False (prompts keep their sliding KV) or True. `FakeKv` plays the
model runner: it mirrors the rows and the full -> sliding page map from the deltas the
ledger returns and writes both layers' KV through them, so a read is checked against what
the runner would really find. The rules build the hard cases on purpose: requests sharing
prefixes with finished ones, re-entering a finished request's long output, diverging
inside it; chunked prefill with `cache_unfinished` between chunks; prompt-logprobs
requests (`match_prefix=False`); decode far past the window; finish / abort / retract
(retract when a decode step is short); session turns that restore after the previous turn
decoded past the window, or fall back to the tree; close; eviction under pressure;
`drop_cache` at idle. The two example tests at the end pin two findings of these machines.

Oracles, besides `check_invariants` after every rule:

(a) after every op that takes a deltas list, the runner's replica of the page map, built
    only from `SwaMapDelta`s (in list order; sliding page 0 unmaps), equals the ledger's;
(b) every query an extend grant or a decode step computes finds its whole window
    ([q - window + 1, q]) with sliding pages, in the ledger's map and through the runner's
    replica, holding the KV of the right token at the right position;
(c) tree heal: a request that ran alone (no other request or session locks anything)
    finishes, and the same tokens sent again match at least the longest page-aligned prefix
    whose last window had sliding KV in the finished request's row;
(d) a restored session turn's record passes the checker (named as such);
(e) with `swa_free_prompt` False, the prompt positions a request computed itself and still
    owns (not handed to the tree) keep their sliding KV while it runs (a restored turn is
    exempt: its history may already be gone);
(f) the prefix tree's digest marks as dead ends exactly the block ends the ledger would
    not resume a request after (`_swa_usable`, on the ledger's own sliding map);
and a refused admission or decode changes no pool, map or tree (its deltas may only carry
unmaps), and the records are exactly the requests holding KV or waiting after a retraction.

`SWA_MUTANTS` in tests/unit/test_ledger_mutants.py plant sliding-window bugs that these
machines must catch.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from actors.allocator.ledger import KvLedger
from kvcore import InvariantViolation, SwaPages, check_invariants, floor_page
from kvcore.tiers import KvTier, PrefixIndex
from tests.unit.ledger_driver import (
    FakeKv,
    FakeTierPort,
    RequestViews,
    expected_dead_ends,
    is_map_delta,
    make_ledger,
    run_sync,
)
from tests.unit.test_ledger_properties import BASES, SETTINGS

SESSIONS = ("s0", "s1")
# Host tier below the pool (FakeTierPort); off twice. "demote_later": files written beside.
TIERS = ("off", "pressure", "off", "demote", "demote_later")
MODES = ("keep_prompt", "free_prompt", "keep_prompt", "off")  # the default mode twice
LOGPROBS = st.sampled_from([False, False, False, True])  # prompt logprobs: no prefix match
SUFFIX = st.lists(st.integers(0, 50), min_size=1, max_size=12)


class SwaLedgerMachine(RequestViews, RuleBasedStateMachine):
    page_size = 1
    capacity = 96
    window_unit = 1  # window = drawn units * window_unit tokens
    step_unit = 1  # swa_free_step = drawn units * step_unit tokens
    ledger_class: type = KvLedger
    check_runner_map = True  # oracle (a), and (b) through the runner's replica
    tier: str | None = None  # one of TIERS for every example (None: drawn)

    @initialize(
        pages=st.sampled_from([240, 120, 64, 24]),  # at page size 1; scaled down at 16
        swa_share=st.sampled_from([1.0, 0.6, 0.3]),  # sliding pages per full page
        rows=st.integers(1, 6),
        mode=st.sampled_from(MODES),
        window=st.integers(2, 12),
        step=st.integers(1, 4),
        tier=st.sampled_from(TIERS),
    )
    def setup(self, pages, swa_share, rows, mode, window, step, tier):
        tier = self.tier or tier
        ps = self.page_size
        num_pages = pages if ps == 1 else 4 + pages // 6
        num_swa = max(2, int(num_pages * swa_share))
        self.mode = mode
        self.window = window * self.window_unit if mode != "off" else 0
        # digest blocks of a few pages, so the tree's dead ends are checked (oracle (f))
        self.ledger, self.tree = make_ledger(
            num_pages,
            ps,
            rows,
            self.capacity,
            cls=self.ledger_class,
            digest_block=4 if ps == 1 else ps,
            window=self.window,
        )
        if mode != "off":
            self.ledger.swa = SwaPages(num_pages, num_swa, ps)
            self.ledger.window = self.window
            self.ledger.swa_free_step = step * self.step_unit
            self.ledger.swa_free_prompt = mode == "free_prompt"
        self.kv = FakeKv(self.ledger.pool.num_slots, ps, num_swa if mode != "off" else 0)
        self.writes_started: list[int] = []  # handles whose file the "runner" writes now
        self.writes_ended: dict[int, int | None] = {}  # written (or failed), not yet told
        if tier != "off":
            # Tiers below the pool. "pressure": idle sessions are demoted under pressure into
            # a host tier that holds about one. "demote": every idle session is demoted at
            # once, into a host tier that holds about half of one and a disk tier below it.
            # Both keep the prefix-tree blocks the pool evicts there too.
            self.ledger.tiers = FakeTierPort(self.kv)
            self.ledger.prefix_blocks = PrefixIndex(ps)
            self.ledger.host = KvTier("host", 8 * 2 * self.capacity)
            self.ledger.session_max_pages = None
            if tier in ("demote", "demote_later"):
                self.ledger.host = KvTier("host", 8 * self.capacity)
                self.ledger.disk = KvTier("disk", 8 * 2 * self.capacity)
                self.ledger.session_max_pages = 0
            if tier == "demote_later":
                # Two-phase spills (the rules below end the writes, in any order), into a
                # host tier that holds about a quarter of one: nearly every demotion spills.
                self.ledger.host = KvTier("host", 8 * self.capacity // 4)
                self.ledger.spill_later = self.writes_started.append
        self.tokens: dict[int, np.ndarray] = {}  # live requests' known tokens
        self.match: dict[int, bool] = {}  # False: prompt logprobs (match_prefix=False)
        self.session: dict[int, str] = {}  # rid -> its session ("" for none)
        self.prompt_len: dict[int, int] = {}
        self.span: dict[int, tuple[int, int] | None] = {}  # prompt positions it computed
        self.retracted: set[int] = set()
        self.finished: list[tuple[np.ndarray, int]] = []  # (tokens, prompt length)
        self.history: dict[str, np.ndarray] = {}  # session -> tokens of its last turn
        self.turn_of: dict[str, int] = {}  # session -> rid of its unfinished turn
        self.next_rid = 0

    # -- helpers --
    def _add(self, toks, match=True, session="") -> int | None:
        toks = np.asarray(toks if len(toks) else [7], dtype=np.int64)
        if len(toks) > self.capacity - 1:
            event("a prompt too long for the row was not sent")
            return None
        rid = self.next_rid
        self.next_rid += 1
        self.tokens[rid] = toks
        self.match[rid] = match
        self.session[rid] = session
        self.prompt_len[rid] = len(toks)
        self.span[rid] = None
        if session:
            self.turn_of[session] = rid
        return rid

    def _drop(self, rid) -> None:
        """The model forgets a request that holds no record."""
        sid = self.session.pop(rid)
        if sid and self.turn_of.get(sid) == rid:
            del self.turn_of[sid]
        for d in (self.tokens, self.match, self.prompt_len, self.span):
            d.pop(rid, None)
        self.retracted.discard(rid)

    def _state(self):
        """What a refusal must leave as it was."""
        tree = None
        if self.tree is not None:
            tree = (
                sorted(self.tree.owned_slots().tolist()),
                self.tree.evictable_size,
                self.tree.protected_size,
            )
        swa = None
        if self.ledger.swa is not None:
            swa = (
                sorted(self.ledger.swa.pool.free_pages().tolist()),
                self.ledger.swa.map.tobytes(),
            )
        return sorted(self.ledger.pool.free_pages().tolist()), swa, tree

    def _apply(self, deltas, op: str) -> None:
        """The runner applies a deltas list; oracle (a)."""
        self.kv.apply(deltas, self.capacity)
        if self.ledger.swa is None or not self.check_runner_map:
            return
        want = self.ledger.swa.map
        differ = np.flatnonzero(self.kv.swa_map != want)
        assert not differ.size, (
            f"(a) after {op}: the runner's page map differs from the ledger's at full pages "
            f"{differ[:8].tolist()}: runner {self.kv.swa_map[differ[:8]].tolist()}, "
            f"ledger {want[differ[:8]].tolist()}"
        )

    @staticmethod
    def _only_unmaps(deltas) -> bool:
        return all(is_map_delta(d) and not np.asarray(d.swa_pages).any() for d in deltas)

    def _check_window(self, rid, row, q_lo, q_hi, op: str) -> None:
        """Oracle (b): queries [q_lo, q_hi) of `rid` find their windows."""
        if self.ledger.swa is None:
            return
        ps = self.page_size
        lo = max(0, q_lo - self.window + 1)
        slots = self.ledger.table.table[row, lo:q_hi]
        pages = slots // ps
        lost = np.flatnonzero(self.ledger.swa.map[pages] == 0)
        assert not lost.size, (
            f"(b) {op}: request {rid}'s queries [{q_lo}, {q_hi}) read position "
            f"{lo + int(lost[0])} (window {self.window}), whose full page {int(pages[lost[0]])} "
            f"has no sliding page in the ledger's map"
        )
        if not self.check_runner_map:
            return
        rslots = self.kv.replica[row][lo:q_hi]
        assert np.array_equal(rslots, slots), f"(b) {op}: the runner's row {row} differs"
        swa = self.kv.sliding_slots(rslots)
        toks = self.tokens[rid][lo:q_hi]
        positions = np.arange(lo, q_hi)
        bad = np.flatnonzero(
            (swa < ps) | (self.kv.swa_token[swa] != toks) | (self.kv.swa_pos[swa] != positions)
        )
        if bad.size:
            k = int(bad[0])
            page = int(rslots[k]) // ps
            raise AssertionError(
                f"(b) {op}: request {rid}'s queries [{q_lo}, {q_hi}) read position {lo + k} "
                f"through the runner's map: full page {page} -> sliding page "
                f"{int(self.kv.swa_map[page])} (ledger: {int(self.ledger.swa.map[page])}), "
                f"which holds token {int(self.kv.swa_token[swa[k]])} at position "
                f"{int(self.kv.swa_pos[swa[k]])}, not token {int(toks[k])}"
            )

    def _extend(self, rid, budget):
        """One alloc_extend with every oracle; the grant or None."""
        toks, sid = self.tokens[rid], self.session[rid]
        rec = self._rec(rid)
        admitting = rec is None or not rec.is_held
        slot = self.ledger.slots.get(sid) if sid else None
        slot_rec = slot.rec if slot is not None else None
        evicted = slot_rec.swa_evicted_seqlen if slot_rec is not None else 0
        before = self._state()
        hits = self.ledger.counters.session_hit_tokens
        reclaims = getattr(self.ledger.counters, "session_reclaims", 0)
        deltas = []
        pending = len(self.ledger._pending)  # a prefetch's deltas go out first, whatever
        grant = run_sync(
            self.ledger.alloc_extend(
                rid, toks, budget, deltas, match_prefix=self.match[rid], session=sid
            )
        )
        self._apply(deltas, "alloc_extend")
        if grant is None:
            event("extend refused")
            assert self._only_unmaps(deltas[pending:]), (
                "a refused extend returned row or mapping deltas"
            )
            assert (self._rec(rid) is not None) == (rec is not None), "a refusal made a record"
            if slot is not None and slot.rec is not slot_rec:
                event("a refused turn released its session's KV to the tree")
            elif getattr(self.ledger.counters, "session_reclaims", 0) > reclaims:
                raise AssertionError(
                    f"request {rid}'s admission was refused after it released an idle "
                    "session's slot to the tree (a refusal should change nothing)"
                )
            else:
                assert self._state() == before, "a refusal changed the pools or the tree"
            return None
        assert grant.end > grant.start, f"request {rid}: a grant that computes no token"
        restored = self.ledger.counters.session_hit_tokens > hits
        if slot_rec is not None and not restored:
            event("a turn fell back to the tree")
        if grant.cached_len:
            event("extend restored a session" if restored else "extend hit the prefix cache")
            self.kv.assert_row_holds(grant.row, toks, grant.cached_len)
        if restored:
            if evicted:
                event("a turn restored after the previous turn's window freed KV")
            try:
                check_invariants(run_sync(self.ledger.snapshot()))
            except InvariantViolation as exc:
                raise AssertionError(
                    f"(d) the restored turn {rid} (slot {sid!r}, swa_evicted_seqlen "
                    f"{evicted}, restored {grant.cached_len} of {len(toks)} tokens): {exc}"
                ) from exc
        self.kv.write(grant.row, toks, grant.start, grant.end)
        self.kv.assert_row_holds(grant.row, toks, grant.end)
        self._check_window(
            rid, grant.row, grant.start, grant.end, f"alloc_extend [{grant.start}, {grant.end})"
        )
        # A history promoted from a tier whose window had freed KV keeps that freed range
        # (a record has one), so the window may free the prompt past it, as for a restore.
        dead_history = admitting and not restored and self._rec(rid).swa_evicted_seqlen > 0
        if dead_history:
            event("a turn promoted a history whose window had freed KV")
        if admitting:
            self.span[rid] = None if restored or dead_history else (grant.start, len(toks))
            self.retracted.discard(rid)
        return grant

    def _cache_unfinished(self, rid):
        rec = self._rec(rid)
        free_before = self.ledger.pool.num_free
        deltas = []
        run_sync(self.ledger.cache_unfinished(rid, self.tokens[rid], deltas))
        self._apply(deltas, "cache_unfinished")
        if self.ledger.pool.num_free > free_before:
            event("cache_unfinished freed duplicate pages")
        self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], rec.kv_committed_len)

    def _prefill(self, rid, budget, cache_between=True) -> bool:
        """Chunks until the prompt is in KV (cache_unfinished between them); False when the
        pool refuses a chunk."""
        for _ in range(self.capacity):
            rec = self._rec(rid)
            if rec is not None and rec.is_held and rec.kv_committed_len == len(self.tokens[rid]):
                return True
            grant = self._extend(rid, budget)
            if grant is None:
                return False
            if grant.end < len(self.tokens[rid]) and cache_between:
                self._cache_unfinished(rid)
        raise AssertionError(f"request {rid} never finished its prefill")

    def _decode(self, rids, new_tokens) -> int:
        """One decode step for `rids`; the shortfall (then nothing changed)."""
        before = self._state()
        deltas = []
        pending = len(self.ledger._pending)  # a prefetch's deltas go out first, whatever
        short = run_sync(self.ledger.alloc_decode(rids, deltas))
        self._apply(deltas, "alloc_decode")
        if short:
            event("decode short")
            assert self._only_unmaps(deltas[pending:]), (
                "a short decode returned row or mapping deltas"
            )
            assert self._state() == before, "a short decode changed the pools or the tree"
            return short
        for rid, tok in zip(rids, new_tokens):
            rec = self._rec(rid)
            self.tokens[rid] = np.append(self.tokens[rid], tok)
            pos = rec.kv_committed_len - 1
            assert pos == len(self.tokens[rid]) - 1
            self.kv.write(rec.req_pool_idx, self.tokens[rid], pos, pos + 1)
            self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], pos + 1)
            self._check_window(rid, rec.req_pool_idx, pos, pos + 1, f"decode of position {pos}")
        return 0

    def _draw_finished(self, data):
        """A finished request's (tokens, prompt length), one with an output longer than the
        window when there is one."""
        long = [f for f in self.finished if len(f[0]) - f[1] > self.window]
        return data.draw(st.sampled_from(long or self.finished))

    def _decode_steps(self, rid, steps, token) -> None:
        """Decode `rid` alone for up to `steps` steps (at most a little more than twice the
        window and freeing step); retract it when a step is short."""
        ps, step = self.page_size, self.ledger.swa_free_step
        steps = min(steps, max(8, 2 * self.window + 2 * step + 2 * ps))
        for i in range(steps):
            if len(self.tokens[rid]) >= self.capacity:
                return
            if self._decode([rid], [(token + 3 * i) % 50]):
                self._retract(rid)
                event("retracted under pressure")
                return
        if self.window and len(self.tokens[rid]) > self.window + self.page_size:
            event("decoded past the window")

    def _speculative_steps(self, data, rid, steps, token) -> None:
        """Decode `rid` alone with draft tokens: each step reserves 1 + k slots, writes KV
        in all of them (every query's window checked), then commits a drawn number of them
        (the rejected tail freed); retract it when a step is short."""
        for i in range(steps):
            room = self.capacity - len(self.tokens[rid]) - 1
            if room < 0:
                return
            k = data.draw(st.integers(0, min(6, room)), label="drafts")
            before = self._state()
            deltas = []
            short = run_sync(self.ledger.alloc_decode([rid], deltas, [k]))
            self._apply(deltas, "alloc_decode with drafts")
            if short:
                assert self._state() == before, "a short speculative step changed the pools"
                self._retract(rid)
                event("retracted under pressure")
                return
            rec = self._rec(rid)
            run_sync(self.ledger.check())  # between the reservation and its commit too
            start = len(self.tokens[rid])
            candidate = np.append(
                self.tokens[rid], [(token + 7 * i + j) % 50 for j in range(1 + k)]
            )
            self.tokens[rid] = candidate  # the window oracle reads the step's tokens
            self.kv.write(rec.req_pool_idx, candidate, start, start + 1 + k)
            self._check_window(rid, rec.req_pool_idx, start, start + 1 + k, "a speculative step")
            if k == 0:
                continue
            accepted = data.draw(st.integers(1, 1 + k), label="accepted")
            run_sync(self.ledger.commit_draft(rid, accepted))
            self.tokens[rid] = candidate[: start + accepted]
            assert rec.kv_committed_len == rec.kv_allocated_len == start + accepted
            self.kv.assert_row_holds(rec.req_pool_idx, self.tokens[rid], start + accepted)
            event("speculative step committed" if accepted > k else "draft tail rejected")

    def _retract(self, rid) -> None:
        run_sync(self.ledger.retract(rid, self.tokens[rid]))
        self.retracted.add(rid)
        self.span[rid] = None

    def _heal_expected(self, rec) -> int:
        """Oracle (c)'s bound: the longest page-aligned prefix of the committed tokens whose
        last window has sliding pages in this (held) record's row."""
        ps = self.page_size
        end_max = floor_page(rec.kv_committed_len, ps)
        if self.ledger.swa is None:
            return end_max
        row = self.ledger.table.table[rec.req_pool_idx, :end_max:ps]
        mapped = self.ledger.swa.map[row // ps] > 0
        for end_page in range(len(mapped), 0, -1):
            first = max(0, end_page * ps - self.window + 1) // ps
            if mapped[first:end_page].all():
                return end_page * ps
        return 0

    def _finish(self, rid, resend_token=None) -> None:
        toks, sid = self.tokens[rid], self.session[rid]
        rec = self._rec(rid)
        lone = (
            resend_token is not None
            and not sid
            and self._held() == [rid]
            and not self.ledger.session_lock_nodes
            and len(toks) < self.capacity - 1
        )
        expected = self._heal_expected(rec) if lone else None
        run_sync(self.ledger.finish(rid, toks))
        self.finished.append((toks, self.prompt_len[rid]))
        if sid:
            self.history[sid] = toks
        after = self._rec(rid)  # a session turn's record moved to its slot
        assert after is None or not after.is_held
        self.ledger.forget(rid)
        self._drop(rid)
        if not lone:
            return
        again = self._add([*toks, resend_token])
        grant = self._extend(again, 10_000)
        if grant is None:
            event("(c) the re-sent request was refused")
            self._drop(again)
            return
        event("(c) checked")
        assert grant.cached_len >= expected, (
            f"(c) request {rid} ran alone and finished with {len(toks)} tokens committed, "
            f"sliding KV whole up to the window before {expected}; the same tokens sent again "
            f"match only {grant.cached_len}"
        )

    # -- rules: new requests --
    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 50), max_size=12),
        logprobs=LOGPROBS,
    )
    def new_request(self, base, cut, suffix, logprobs):
        self._add(base[:cut] + suffix, match=not logprobs)

    @rule(data=st.data(), extra=SUFFIX, logprobs=LOGPROBS)
    def reenter_output(self, data, extra, logprobs):
        """A finished request's whole history (prompt and output) and more."""
        if not self.finished:
            return
        toks, _ = self._draw_finished(data)
        self._add([*toks, *extra], match=not logprobs)

    @rule(data=st.data(), extra=SUFFIX, logprobs=LOGPROBS)
    def diverge_in_output(self, data, extra, logprobs):
        """A finished request's history cut inside its output (or its prompt), then new."""
        if not self.finished:
            return
        toks, plen = self._draw_finished(data)
        at = data.draw(st.integers(min(plen, len(toks) - 1), len(toks) - 1))
        self._add([*toks[:at], *extra], match=not logprobs)

    @rule(
        data=st.data(),
        extra=SUFFIX,
        logprobs=LOGPROBS,
        chunk=st.sampled_from([1, 2, 4, 8, 16, 24]),
    )
    def reenter_output_chunked(self, data, extra, logprobs, chunk):
        """Diverge inside (or re-enter) a finished output, then prefill it in chunks with
        cache_unfinished between: the tree's pages past the window may be swapped in."""
        if not self.finished:
            return
        toks, plen = self._draw_finished(data)
        at = data.draw(st.integers(min(plen, len(toks)), len(toks)))
        rid = self._add([*toks[:at], *extra], match=not logprobs)
        if rid is not None:
            self._prefill(rid, chunk * max(1, self.page_size // 4))

    @rule(
        data=st.data(),
        extra=SUFFIX,
        other=SUFFIX,
        logprobs=LOGPROBS,
        chunk=st.sampled_from([1, 2, 4, 8, 16, 24]),
    )
    def read_and_diverge_in_one_output(self, data, extra, other, logprobs, chunk):
        """One request re-enters a finished output (its match locks the tree's pages, dead
        ones included), then another diverges inside that output and prefills in chunks
        with cache_unfinished between: a dead page it meets is locked, so not healable."""
        if not self.finished:
            return
        toks, plen = self._draw_finished(data)
        reader = self._add([*toks, *extra])
        if reader is None or self._extend(reader, 10_000) is None:
            return
        if self.ledger.swa is not None:
            rec = self._rec(reader)
            row = self.ledger.table.table[rec.req_pool_idx, : rec.cache_protected_len]
            if (self.ledger.swa.map[row // self.page_size] == 0).any():
                event("a reader locks dead tree pages")
        at = data.draw(st.integers(min(plen, len(toks)), len(toks)))
        rid = self._add([*toks[:at], *other], match=not logprobs)
        if rid is not None:
            self._prefill(rid, chunk * max(1, self.page_size // 4))

    # -- rules: prefill --
    @rule(data=st.data(), budget=st.integers(1, 24), cache_after=st.booleans())
    def extend(self, data, budget, cache_after):
        waiting = self._not_done()
        if not waiting:
            return
        rid = data.draw(st.sampled_from(waiting))
        grant = self._extend(rid, budget)
        if grant is not None and cache_after and grant.end < len(self.tokens[rid]):
            self._cache_unfinished(rid)

    @rule(data=st.data(), budget=st.integers(4, 64))
    def prefill_to_end(self, data, budget):
        waiting = self._not_done()
        if waiting:
            self._prefill(data.draw(st.sampled_from(waiting)), budget)

    @rule(data=st.data())
    def cache_unfinished(self, data):
        cands = self._prefilling()
        if cands:
            self._cache_unfinished(data.draw(st.sampled_from(cands)))

    # -- rules: decode --
    @rule(data=st.data(), new_token=st.integers(0, 50))
    def decode(self, data, new_token):
        cands = [r for r in self._decoding() if len(self.tokens[r]) < self.capacity]
        if not cands:
            return
        rids = data.draw(st.lists(st.sampled_from(cands), min_size=1, unique=True))
        if self._decode(rids, [new_token] * len(rids)):
            self._retract(data.draw(st.sampled_from(rids)))
            event("retracted under pressure")

    @rule(data=st.data(), steps=st.integers(1, 100), token=st.integers(0, 50))
    def decode_past_window(self, data, steps, token):
        cands = [r for r in self._decoding() if len(self.tokens[r]) < self.capacity]
        if cands:
            self._decode_steps(data.draw(st.sampled_from(cands)), steps, token)

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 40),
        suffix=st.lists(st.integers(0, 50), max_size=12),
        chunk=st.integers(4, 64),
        token=st.integers(0, 50),
        resend=st.integers(0, 50),
    )
    def long_output_request(self, base, cut, suffix, chunk, token, resend):
        """A request prefills, decodes well past the window and finishes: the tree gets
        pages whose sliding KV the window freed (dead), for later requests to meet."""
        rid = self._add(base[:cut] + suffix)
        if rid is None or not self._prefill(rid, chunk):
            return
        self._decode_steps(rid, self.capacity, token)
        if rid in self.tokens and rid not in self.retracted:
            self._finish(rid, resend)

    # -- rules: release --
    @rule(
        data=st.data(),
        kind=st.sampled_from(["finish", "finish", "abort", "retract"]),
        resend=st.integers(0, 50),
    )
    def release(self, data, kind, resend):
        cands = self._decoding() if kind == "finish" else self._held()
        if not cands:
            return
        rid = data.draw(st.sampled_from(cands))
        if kind == "finish":
            self._finish(rid, resend)
        elif kind == "abort":
            run_sync(self.ledger.abort(rid))
            run_sync(self.ledger.abort(rid))  # idempotent
            assert self._rec(rid).is_released
            self.ledger.forget(rid)
            self._drop(rid)
        else:
            self._retract(rid)
            assert self._rec(rid).is_released

    @rule(data=st.data(), n=st.integers(1, 8))
    def fill_the_pool_with_cached_pages(self, data, n):
        """Finish short requests until the pool is full of tree pages: admission evicts."""
        for _ in range(n):
            base = data.draw(st.sampled_from(BASES))
            rid = self._add([*base, self.next_rid % 50])
            if self._extend(rid, 64) is None:
                self._drop(rid)
                return
            if self._rec(rid).kv_committed_len < len(self.tokens[rid]):
                run_sync(self.ledger.abort(rid))
                self.ledger.forget(rid)
                self._drop(rid)
            else:
                self._finish(rid)

    @rule()
    def drop_cache_at_idle(self):
        if self.ledger.records:
            return
        run_sync(self.ledger.drop_cache())
        self.history.clear()
        if self.ledger.host is not None:  # drop_cache follows a runner restart: a fresh store
            self.ledger.tiers.entries.clear()
            self.ledger.tiers.on_disk.clear()

    # -- rules: files written beside the mailbox ("demote_later") --
    def _advance_writes(self, data) -> None:
        """Some of the writes under way end, in part or whole (after a whole turn, which is
        where demotions come from, so that ends interleave with the next turns)."""
        for _ in range(data.draw(st.integers(0, 2)) if self.writes_started else 0):
            self.write_a_file(data, data.draw(st.sampled_from([False, False, False, True])))
        for _ in range(data.draw(st.integers(0, 2)) if self.writes_ended else 0):
            self.end_a_write(data)

    @rule(data=st.data(), fails=st.booleans())
    def write_a_file(self, data, fails):
        """The store's part of a spill: the file is written (the store then reports it on
        disk) or fails; a handle dropped meanwhile fails as the store's commit does."""
        if not self.writes_started:
            return
        handle = self.writes_started.pop(data.draw(st.integers(0, len(self.writes_started) - 1)))
        port = self.ledger.tiers
        event("a file is written beside the mailbox")
        if fails or handle not in port.entries:
            self.writes_ended[handle] = None
        else:
            self.writes_ended[handle] = run_sync(port.spill(handle))

    @rule(data=st.data())
    def end_a_write(self, data):
        """The ledger's part: `spill_done`, in any order, however late."""
        if not self.writes_ended:
            return
        handle = data.draw(st.sampled_from(sorted(self.writes_ended)))
        nbytes = self.writes_ended.pop(handle)
        if handle in self.ledger.writing:
            event("a file written beside" if nbytes is not None else "a write failed")
        run_sync(self.ledger.spill_done(handle, nbytes))

    # -- rules: sessions --
    @rule(
        sid=st.sampled_from(SESSIONS),
        priority=st.integers(-1, 1),
        retain_s=st.sampled_from([0.0, 0.0, 3600.0]),
    )
    def open_session(self, sid, priority, retain_s):
        """A client's hints order reclaims and tier drops; nothing may break either way."""
        self.ledger.open_slot(sid, priority, retain_s)

    @rule(sid=st.sampled_from(SESSIONS))
    def close_session(self, sid):
        run_sync(self.ledger.close_slots([sid]))

    @rule(sid=st.sampled_from(SESSIONS), prefetch=st.booleans())
    def hint_session(self, sid, prefetch):
        """A client's hint between turns: the session's KV out of the pool (offload), or
        back into it from its tier (prefetch); its next turn then restores or loads."""
        if self.ledger.host is None:
            return
        if prefetch:
            run_sync(self.ledger.prefetch_slot(sid))
        else:
            run_sync(self.ledger.offload_slot(sid))

    def _turn_prompt(self, data, sid, how, suffix):
        hist = self.history.get(sid)
        if how == "fresh" or hist is None:
            base = data.draw(st.sampled_from(BASES))
            return base[: data.draw(st.integers(0, 40))] + suffix
        if how == "continue":
            return [*hist, *suffix]
        return [*hist[: data.draw(st.integers(0, len(hist)))], *suffix]

    def _can_start_turn(self, sid) -> bool:
        slot = self.ledger.slots.get(sid)
        return slot is not None and slot.turn is None and sid not in self.turn_of

    @rule(
        data=st.data(),
        sid=st.sampled_from(SESSIONS),
        how=st.sampled_from(["continue", "continue", "diverge", "fresh"]),
        suffix=SUFFIX,
        logprobs=LOGPROBS,
        budget=st.integers(1, 64),
    )
    def session_turn(self, data, sid, how, suffix, logprobs, budget):
        """A session's next turn is admitted (restored from its slot, or from the tree)."""
        if self._can_start_turn(sid):
            rid = self._add(self._turn_prompt(data, sid, how, suffix), not logprobs, sid)
            if rid is not None:
                self._extend(rid, budget)

    @rule(
        data=st.data(),
        sid=st.sampled_from(SESSIONS),
        how=st.sampled_from(["continue", "continue", "diverge", "fresh"]),
        suffix=SUFFIX,
        chunk=st.integers(4, 64),
        steps=st.integers(1, 100),
        token=st.integers(0, 50),
    )
    def whole_session_turn(self, data, sid, how, suffix, chunk, steps, token):
        """Open the session if needed and run one whole turn: prefill in chunks, decode
        (often past the window), finish; the next turn then restores or falls back."""
        self.ledger.open_slot(sid)
        if not self._can_start_turn(sid):
            return
        rid = self._add(self._turn_prompt(data, sid, how, suffix), True, sid)
        if rid is None or not self._prefill(rid, chunk):
            return
        self._decode_steps(rid, steps, token)
        if rid in self.tokens and rid not in self.retracted:
            self._finish(rid)
        self._advance_writes(data)

    # -- oracles after every rule --
    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "ledger"):
            return
        run_sync(self.ledger.check())
        if self.ledger.host is not None:
            assert run_sync(self.ledger._tier_problems(audit_store=True)) == []
        # (f) the digest's dead ends are the prefixes the ledger would not resume after
        ledger = self.ledger

        def resumable(slots, alive, end):
            return ledger._swa_usable(slots[:end], end) == end

        dead = set(self.tree.dead_ends())
        assert dead == expected_dead_ends(self.tree, resumable)
        if dead:
            event("the digest has dead ends")
        holding = set(self._held())
        assert set(self.ledger.records) == holding | self.retracted, (
            f"records {sorted(self.ledger.records)} but requests holding KV or retracted "
            f"{sorted(holding | self.retracted)}"
        )
        if self.mode != "keep_prompt":
            return
        ps = self.page_size
        for rid in holding:
            if self.span.get(rid) is None:
                continue
            rec = self._rec(rid)
            a, b = self.span[rid]
            a = max(a, rec.cache_protected_len)  # what it handed to the tree is the tree's
            slots = self.ledger.table.table[rec.req_pool_idx, a : min(b, rec.kv_allocated_len)]
            lost = np.flatnonzero(self.ledger.swa.map[slots // ps] == 0)
            assert not lost.size, (
                f"(e) request {rid} computed its prompt positions [{a}, {b}) with "
                f"swa_free_prompt False, but position {a + int(lost[0])} lost its sliding KV"
            )

    def teardown(self):
        if not hasattr(self, "ledger"):
            return
        for rid in list(self.tokens):
            run_sync(self.ledger.abort(rid))
            self.ledger.forget(rid)
        run_sync(self.ledger.close_slots(list(self.ledger.slots)))
        run_sync(self.ledger.check())
        assert not self.ledger.records, f"records left: {sorted(self.ledger.records)}"
        assert run_sync(self.ledger.idle_problems()) == []
        run_sync(self.ledger.drop_cache())
        deltas = []
        assert run_sync(self.ledger.alloc_decode([], deltas)) == 0
        self._apply(deltas, "the first decode after everything was dropped")
        assert self.ledger.pool.num_free == self.ledger.pool.num_pages
        if self.ledger.swa is not None:
            assert self.ledger.swa.num_free == self.ledger.swa.num_pages


class SwaLedgerMachinePage16(SwaLedgerMachine):
    page_size = 16
    capacity = 128
    window_unit = 4  # windows of 8..48 tokens
    step_unit = 8


class SpeculativeSwaLedgerMachine(SwaLedgerMachinePage16):
    """The same machine with speculative steps among its rules (a machine of its own, so
    the other machines explore as they did)."""

    @rule(data=st.data(), steps=st.integers(1, 40), token=st.integers(0, 50))
    def speculate(self, data, steps, token):
        """Speculative steps (a session's turn too: its save after a partly rejected step
        must be at rest and restore exactly the committed tokens)."""
        cands = [r for r in self._decoding() if len(self.tokens[r]) < self.capacity]
        if cands:
            self._speculative_steps(data, data.draw(st.sampled_from(cands)), steps, token)


class SpillLaterLedgerMachine(SwaLedgerMachinePage16):
    """Every example demotes into tiers whose files are written beside the mailbox."""

    tier = "demote_later"


TestSwaLedgerPage1 = SwaLedgerMachine.TestCase
TestSwaLedgerPage1.settings = SETTINGS
TestSwaLedgerPage16 = SwaLedgerMachinePage16.TestCase
TestSwaLedgerPage16.settings = SETTINGS
TestSpeculativeSwaLedger = SpeculativeSwaLedgerMachine.TestCase
TestSpeculativeSwaLedger.settings = SETTINGS


# ---- two findings of these machines, as examples (they fail until the ledger changes) ----


def test_a_refused_admission_leaves_an_idle_session_as_it_was():
    """alloc_extend: "Returns None, changing nothing". With no free row, admission releases
    the least recently used idle session to the tree before it knows the pages suffice; when
    they do not, the refusal has already emptied the session's slot."""
    ledger, tree = make_ledger(8, 4, 2, 64)
    ledger.open_slot("s")
    prompt = np.arange(10, 18)
    assert run_sync(ledger.alloc_extend(1, prompt, 64, [], session="s")) is not None
    run_sync(ledger.finish(1, np.append(prompt, 5)))  # the slot: 8 tokens, 2 pages, a row
    ledger.forget(1)
    assert run_sync(ledger.alloc_extend(2, np.arange(100, 120), 64, [])) is not None
    saved = ledger.slots["s"].rec
    # 5 pages needed; 1 free + the slot's 2 cannot cover them: refused.
    assert run_sync(ledger.alloc_extend(3, np.arange(200, 220), 64, [])) is None
    check_invariants(run_sync(ledger.snapshot()))
    assert ledger.slots["s"].rec is saved, "a refused admission released an idle session"


def test_cache_unfinished_and_the_checker_agree_on_the_window_the_next_chunk_reads():
    """A chunk over a finished output whose dead pages another request locks: cache_unfinished
    takes the tree's pages below need_alive_from = committed - window + 1 (the next chunk's
    first query reads from there), dead ones included; the checker wants the window from
    committed - window on, one position more, and raises although no query reads it."""
    ps, window = 1, 4
    ledger, tree = make_ledger(200, ps, 8, 128)
    ledger.swa = SwaPages(200, 200, ps)
    ledger.window, ledger.swa_free_step = window, 1

    def check():
        check_invariants(run_sync(ledger.snapshot()))

    toks = np.arange(100, 110)
    run_sync(ledger.alloc_extend(1, toks, 100, []))
    for i in range(30):  # positions 10..35 lose their sliding KV (the prompt keeps its own)
        run_sync(ledger.alloc_decode([1], []))
        toks = np.append(toks, 50 + i)
    run_sync(ledger.finish(1, toks))
    ledger.forget(1)
    assert run_sync(ledger.alloc_extend(2, np.append(toks, 7), 100, [])).cached_len == 40
    prompt = np.concatenate([toks[:20], [1, 2, 3]])  # diverges inside the dead output
    grant = run_sync(ledger.alloc_extend(3, prompt, 2, []))
    assert grant.cached_len == 10
    check()
    while ledger.records[3].kv_committed_len < len(prompt):
        run_sync(ledger.cache_unfinished(3, prompt, []))
        check()
        grant = run_sync(ledger.alloc_extend(3, prompt, 2, []))
        rec = ledger.records[3]
        row = ledger.table.table[rec.req_pool_idx]
        reads = row[max(0, grant.start - window + 1) : grant.end]
        assert (ledger.swa.map[reads // ps] > 0).all()  # what the chunk reads is there
        check()


TestSpillLaterLedger = SpillLaterLedgerMachine.TestCase
TestSpillLaterLedger.settings = SETTINGS
