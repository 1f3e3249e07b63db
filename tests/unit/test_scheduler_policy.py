"""Scheduling policy and the scheduler core with no sockets and no actors: plain data in,
decisions out (admission under a KV snapshot, decode reservation, chunking, victims)."""

from __future__ import annotations

import math

import msgspec
import pytest

from actors.scheduler import policy
from actors.scheduler.batch import PrefillWork, SampledToken, StepOutbox, forward_batch
from actors.scheduler.core import SchedulerCore
from actors.scheduler.policy import (
    CutShort,
    NewTokenRatio,
    Policy,
    Retract,
    SchedulerLimits,
)
from actors.scheduler.request import Req
from transport.messages.alloc import ExtendGrantItem, KvStats, ReleaseKind, SlotDeltas
from transport.messages.engine import FinishReason, NewRequest
from transport.messages.params import GenerationParams
from transport.messages.runner import StepResultMsg

PS = 4
LIMITS = SchedulerLimits(
    page_size=PS, row_capacity=256, max_running=8, max_batch_tokens=64, chunk_size=16
)


def req(rid: int, prompt: int, max_tokens: int = 8, out: int = 0, **kw) -> Req:
    r = Req(
        rid=rid,
        prompt_ids=list(range(10, 10 + prompt)),
        params=GenerationParams(max_tokens=max_tokens, **kw),
        eos_ids=frozenset({2}),
        stop_ids=frozenset(kw.get("stop_token_ids", ())),
    )
    r.output_ids = list(range(500, 500 + out))
    return r


def kv(free: int, evictable: int = 0) -> KvStats:
    return KvStats(
        page_size=PS,
        total_pages=free + evictable,
        free_pages=free,
        tree_pages=evictable,
        held_pages=0,
        session_pages=0,
        evictable_pages=evictable,
        records=0,
        held_rows=0,
        cache_hit_tokens=0,
        evicted_pages=0,
        admitted=0,
        finished=0,
        aborted=0,
        retracted=0,
    )


# ---- the decaying ratio ---------------------------------------------------------------------


def test_new_token_ratio_decays_to_its_floor_and_resets():
    ratio = NewTokenRatio(0.7, 0.1, decay_steps=6)
    for _ in range(3):
        ratio.decay()
    assert ratio.value == pytest.approx(0.4)
    for _ in range(10):
        ratio.decay()
    assert ratio.value == pytest.approx(0.1)
    ratio.reset()
    assert ratio.value == 0.7


def test_new_token_ratio_after_retraction_is_what_the_running_set_used():
    ratio = NewTokenRatio(0.7, 0.1)
    running = [req(1, 4, max_tokens=100, out=30), req(2, 4, max_tokens=100, out=10)]
    ratio.after_retraction(running)
    assert ratio.value == pytest.approx((40 + 2 * policy.RETRACT_TOKEN_RESERVE) / 201)
    ratio.after_retraction([req(3, 4, max_tokens=10, out=9)])
    assert ratio.value == 1.0  # capped


# ---- reservations and admission -------------------------------------------------------------


def test_future_pages_counts_expected_decode_and_the_rest_of_prefill():
    waiting = req(1, 40, max_tokens=100)
    assert policy.future_pages(waiting, 0.5, PS) == math.ceil(50 / PS) + 1
    admitted = req(2, 40, max_tokens=100)
    admitted.admitted, admitted.committed = True, 16  # 24 prompt tokens still to prefill
    assert policy.future_pages(admitted, 0.5, PS) == math.ceil((50 + 24) / PS) + 1
    huge = req(3, 4, max_tokens=100_000)
    assert policy.future_pages(huge, 1.0, PS) == policy.CLIP_MAX_NEW_TOKENS // PS + 1


def test_admission_under_a_tight_budget_stops_at_the_first_that_does_not_fit():
    # Each needs ceil(8/4)=2 prompt pages + ceil(8*0.5/4)+1=2 future pages = 4.
    cands = [req(i, 8, max_tokens=8) for i in range(1, 5)]
    assert policy.admit(cands, [], kv(free=10), 64, LIMITS, 0.5) == cands[:2]
    assert policy.admit(cands, [], kv(free=6, evictable=6), 64, LIMITS, 0.5) == cands[:3]
    # No skipping ahead: a small request behind a big one that does not fit waits too.
    big = req(9, 100, max_tokens=8)
    assert policy.admit([cands[0], big, cands[1]], [], kv(free=8), 64, LIMITS, 0.5) == cands[:1]


def test_admission_tries_the_first_request_when_nothing_runs():
    alone = req(1, 200, max_tokens=8)
    assert policy.admit([alone], [], kv(free=3), 64, LIMITS, 0.5) == [alone]
    running = req(2, 4)
    assert policy.admit([alone], [running], kv(free=3), 64, LIMITS, 0.5) == []


def test_sliding_admission_counts_whole_prompts_when_prompts_keep_their_sliding_kv():
    """Window 16, chunk 16: a request's output holds at most ~10 sliding pages at once, but
    a 100-token prompt that keeps its sliding KV holds 25 for the request's life."""
    limits = SchedulerLimits(
        page_size=PS,
        row_capacity=256,
        max_running=8,
        max_batch_tokens=256,
        chunk_size=16,
        sliding_window=16,
    )
    running = req(10, 4)
    cands = [req(1, 100, max_tokens=8), req(2, 100, max_tokens=8)]
    free = msgspec.structs.replace(kv(free=200), swa_total_pages=200, swa_free_pages=40)
    # Freed prompts: each needs at most its window + a chunk (10 pages): both fit in 40.
    assert policy.admit(cands, [running], free, 256, limits, 0.5) == cands
    # Kept prompts: each needs 25 + 2 sliding pages: only the first fits in 40.
    kept = msgspec.structs.replace(free, swa_keeps_prompt=True)
    assert policy.admit(cands, [running], kept, 256, limits, 0.5) == cands[:1]


def test_decode_reservation_of_running_requests_shrinks_what_admission_sees():
    cands = [req(i, 8, max_tokens=8) for i in range(1, 4)]
    running = [req(10, 8, max_tokens=40, out=0) for _ in range(2)]  # each reserves 6 pages
    for r in running:
        r.admitted, r.committed = True, 8
    assert policy.admit(cands, running, kv(free=20), 64, LIMITS, 0.5) == cands[:2]
    assert policy.admit(cands, running, kv(free=15), 64, LIMITS, 0.5) == cands[:0]


def test_admission_respects_running_slots_and_the_token_budget():
    cands = [req(i, 20) for i in range(1, 10)]
    limits = SchedulerLimits(
        page_size=PS, row_capacity=256, max_running=3, max_batch_tokens=64, chunk_size=16
    )
    assert len(policy.admit(cands, [], kv(free=1000), 64, limits, 0.5)) == 3
    assert len(policy.admit(cands, [req(99, 4)], kv(free=1000), 64, limits, 0.5)) == 2
    # Budget 20 with chunks of 16: the first takes 16, the second gets the 4 left.
    assert len(policy.admit(cands, [], kv(free=1000), 20, LIMITS, 0.5)) == 2


def test_lpm_orders_by_cached_prefix_and_keeps_arrival_order_on_ties():
    a, b, c = req(1, 8), req(2, 8), req(3, 8)
    assert policy.admission_order([a, b, c], None) == [a, b, c]
    assert policy.admission_order([a, b, c], [0, 32, 0]) == [b, a, c]


# ---- chunking -------------------------------------------------------------------------------


def test_chunks_respect_chunk_size_and_budget():
    p1, p2 = req(1, 100), req(2, 10)
    p1.committed, p2.committed = 32, 4
    chunks = policy.continuing_chunks([p1, p2], budget=20, chunk_size=16)
    assert [(c.req, c.budget) for c in chunks] == [(p1, 16), (p2, 4)]
    assert policy.continuing_chunks([p1, p2], budget=0, chunk_size=16) == []
    firsts = policy.first_chunks([req(3, 40), req(4, 5), req(5, 5)], budget=20, chunk_size=16)
    assert [c.budget for c in firsts] == [16, 4]


# ---- victims --------------------------------------------------------------------------------


def test_victim_loses_least_work():
    a = req(1, 10, out=5)
    b = req(2, 10, out=1)
    c = req(3, 30, out=1)  # as few outputs as b, longer prompt: retract it first
    assert policy.pick_victim([a, b, c]) is c
    assert policy.on_decode_shortfall([a], []) == CutShort(a)
    assert policy.on_decode_shortfall([a], [b]) == Retract(b)
    assert policy.on_decode_shortfall([a, c], []) == Retract(c)


def test_unstick_frees_a_stuck_engine():
    a, b, w = req(1, 10), req(2, 20), req(3, 5)
    assert policy.unstick([a], [b], [w]) is None  # something decodes: not stuck
    assert policy.unstick([], [a, b], [w]) == Retract(b)
    assert policy.unstick([], [a], [w]) == CutShort(a)
    assert policy.unstick([], [], [w, a]) == CutShort(w)
    assert policy.unstick([], [], []) is None


def test_finish_reasons():
    r = req(1, 4, max_tokens=3, min_tokens=1, stop_token_ids=[7])
    r.output_ids = [2]
    assert policy.finish_reason(r, 2, 256) is FinishReason.STOP  # eos once min_tokens met
    r.output_ids = [7, 9]
    assert policy.finish_reason(r, 9, 256) is None
    assert policy.finish_reason(r, 7, 256) is FinishReason.STOP
    r.output_ids = [9, 9, 9]
    assert policy.finish_reason(r, 9, 256) is FinishReason.LENGTH
    early = req(2, 4, max_tokens=10, min_tokens=5)
    early.output_ids = [2]
    assert policy.finish_reason(early, 2, 256) is None  # eos before min_tokens is ignored
    full = req(3, 9, max_tokens=100, out=1)
    assert policy.finish_reason(full, 500, 10) is FinishReason.LENGTH  # context full


# ---- the core: a request's path through the queues -----------------------------------------


def core(**kw) -> SchedulerCore:
    return SchedulerCore(LIMITS, policy_name=Policy.FCFS, ratio=NewTokenRatio(0.5, 0.1))


def new(rid: int, n: int, max_tokens: int = 4) -> NewRequest:
    return NewRequest(
        rid=rid,
        prompt_ids=list(range(10, 10 + n)),
        params=GenerationParams(max_tokens=max_tokens),
        eos_ids=[2],
    )


def test_core_admits_prefills_decodes_and_finishes():
    c = core()
    c.submit([new(1, 20), new(2, 4)])
    assert c.has_work and len(c.waiting) == 2
    budget = c.prefill_budget(decode_tokens=0)
    assert budget == 64 and c.wants_admission(budget)
    chunks = c.admissions(budget, kv(free=100))
    assert [(ch.req.rid, ch.budget) for ch in chunks] == [(1, 16), (2, 4)]
    grants = [
        ExtendGrantItem(rid=1, row=1, cached_len=0, start=0, end=16),
        ExtendGrantItem(rid=2, row=-1, cached_len=0, start=0, end=0),
    ]  # 2 refused
    work = c.apply_grants(chunks, grants, SlotDeltas())
    assert [(w.req.rid, w.start, w.end) for w in work] == [(1, 0, 16)]
    assert [r.rid for r in c.prefilling] == [1] and [r.rid for r in c.waiting] == [2]
    batch = c.build_batch([], work)
    assert batch.need_logits == [False] and [r.rid for r in batch.new_reqs] == [1]
    out = StepOutbox()
    unfinished = c.apply_results([], work, StepResultMsg(step=1, rids=[], tokens=[]), out)
    assert [r.rid for r in unfinished] == [1] and not out.reports
    # The last chunk samples a token and moves the request to decoding.
    r1 = c.reqs[1]
    last = [PrefillWork(r1, 16, 20)]
    r1.committed = 20
    c.build_batch([], last)
    c.apply_results([], last, StepResultMsg(step=2, rids=[1], tokens=[40]), out)
    assert c.running == [r1] and r1.output_ids == [40]
    for tok in (41, 42, 43):
        c.on_decode_granted([r1], SlotDeltas())
        c.apply_results([r1], [], StepResultMsg(step=3, rids=[1], tokens=[tok]), out)
    assert 1 not in c.reqs and not c.running  # max_tokens 4 reached
    [release] = out.releases
    assert release.kind is ReleaseKind.FINISH and release.tokens == r1.tokens
    assert out.reports[-1].finish == FinishReason.LENGTH
    assert c.unregister == [1]


def test_a_request_cut_short_before_its_first_token_ends_in_an_error():
    c = core()
    c.submit([new(1, 8), new(2, 8)])
    out = StepOutbox()
    c.cut_short(c.reqs[1], out)  # no token yet: the client must see an error
    c.reqs[2].output_ids = [40]
    c.cut_short(c.reqs[2], out)  # a token already: it ends by length with it
    assert [r.finish for r in out.reports] == [FinishReason.ERROR, FinishReason.LENGTH]
    batch = out.token_batch()  # the error says why (the pool), not "the runner failed"
    assert batch.error_rids == [1] and "KV cache had no room" in batch.error_texts[0]


def test_core_end_aborts_at_the_safe_point_and_reports_cached_once():
    c = core()
    c.submit([new(1, 8)])
    c.end([1, 99], FinishReason.ABORT)  # unknown ids are ignored
    out = StepOutbox()
    c.apply_ends(out)
    assert not c.has_work and not out.releases  # never admitted: nothing to release
    assert [(r.req.rid, r.finish) for r in out.reports] == [(1, FinishReason.ABORT)]
    c.submit([new(2, 8)])
    [chunk] = c.admissions(64, kv(free=100))
    c.apply_grants(
        [chunk], [ExtendGrantItem(rid=2, row=3, cached_len=4, start=4, end=8)], SlotDeltas()
    )
    out = StepOutbox()
    out.report(c.reqs[2], [SampledToken(5)])
    out.report(c.reqs[2], [SampledToken(6)])
    assert out.token_batch().cached == [4, -1]
    c.end([2], FinishReason.ABORT)
    c.apply_ends(out)
    assert out.releases[-1].kind is ReleaseKind.ABORT and out.releases[-1].tokens == []


def test_retraction_puts_the_victim_first_in_line_with_its_kv_mirror_cleared():
    c = core()
    c.submit([new(1, 8, max_tokens=50), new(2, 8, max_tokens=50)])
    chunks = c.admissions(64, kv(free=100))
    grants = [ExtendGrantItem(rid=r, row=r, cached_len=0, start=0, end=8) for r in (1, 2)]
    work = c.apply_grants(chunks, grants, SlotDeltas())
    c.build_batch([], work)
    c.apply_results([], work, StepResultMsg(step=1, rids=[1, 2], tokens=[7, 8]), StepOutbox())
    victim = c.reqs[2]
    assert c.retract_item(victim).kind is ReleaseKind.RETRACT
    c.on_retracted(victim)
    assert c.waiting[0] is victim and not victim.admitted and victim.committed == 0
    assert c.counters.retractions == 1 and c.reqs[2] is victim and victim not in c.running


def test_forward_batch_layout():
    d = req(1, 6, out=2)
    d.row, d.committed, d.registered = 5, 8, True
    p = req(2, 10)
    p.row = 6
    batch, new_reqs = forward_batch(
        7,
        [d],
        [PrefillWork(p, 4, 10)],
        [SlotDeltas(rows=[6], starts=[4], lengths=[1], slots=[99]), SlotDeltas()],
        finished_rids=[3],
    )
    assert batch.rids == [1, 2] and batch.rows == [5, 6]
    assert batch.prefix_lens == [7, 4] and batch.extend_lens == [1, 6]
    assert batch.input_ids == [d.output_ids[-1], *p.tokens[4:10]]
    assert batch.need_logits == [True, True] and batch.finished_rids == [3]
    assert new_reqs == [p] and batch.deltas.slots == [99]


def test_merged_deltas_write_each_position_once_with_its_last_value():
    """A release's unmapping and a later mapping of the same page, or a failed step's row
    writes replayed before the row is reused, meet in one batch: the runner applies a batch
    as one indexed write, so the merge keeps each position's last value."""
    from actors.scheduler.batch import merge_deltas

    first = SlotDeltas(
        rows=[3], starts=[0], lengths=[4], slots=[10, 11, 12, 13],
        swa_full_pages=[2, 5], swa_pages=[0, 7],
    )  # fmt: skip
    later = SlotDeltas(
        rows=[3, 4], starts=[2, 0], lengths=[3, 2], slots=[20, 21, 22, 30, 31],
        swa_full_pages=[2], swa_pages=[9],
    )  # fmt: skip
    merged = merge_deltas([first, later])
    assert (merged.rows, merged.starts, merged.lengths) == ([3, 4], [0, 0], [5, 2])
    assert merged.slots == [10, 11, 20, 21, 22, 30, 31]
    assert dict(zip(merged.swa_full_pages, merged.swa_pages)) == {2: 9, 5: 7}
    assert len(merged.swa_full_pages) == 2


def test_a_turn_whose_kv_is_read_ahead_waits_while_the_others_are_admitted():
    c = core()
    c.submit([new(1, 8), new(2, 8)])
    c.reqs[1].staging = True  # its session's file is being read beside the steps
    budget = c.prefill_budget(decode_tokens=0)
    assert c.wants_admission(budget)
    assert [ch.req.rid for ch in c.admissions(budget, kv(free=100))] == [2]
    assert [ch.req.rid for ch in c.admissions(budget, kv(free=100), [0, 8])] == [2]  # LPM
    assert c.ready() == [c.reqs[2]]
    c.waiting.remove(c.reqs[2])
    assert not c.wants_admission(budget)  # only the staging one waits: nothing to admit
    # nothing runs: the staging turn is not "stuck" (it must not be cut short)
    assert c.unstick() is None
    c.reqs[1].staging = False  # read: admitted as any request
    assert [ch.req.rid for ch in c.admissions(budget, kv(free=100))] == [1]


def test_lpm_order_with_requests_that_arrived_after_the_peek():
    """The scheduler peeks the tree for the waiting requests, then awaits the allocator:
    a request submitted meanwhile has no cached length (it was an IndexError)."""
    c = core()
    c.submit([new(1, 8), new(2, 8)])
    cached_lens = [0, 8]  # peeked for these two
    c.submit([new(3, 8)])  # arrived during the awaits
    order = policy.admission_order(list(c.waiting), cached_lens)
    assert [r.rid for r in order] == [2, 1, 3]
    assert [ch.req.rid for ch in c.admissions(64, kv(free=100), cached_lens)] == [2, 1, 3]
