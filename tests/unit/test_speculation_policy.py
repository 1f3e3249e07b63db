"""Speculative decoding in the scheduler, on plain data: who drafts, how far, the backoff,
the counters, and a drafting request's path through `SchedulerCore` (the forward batch it
builds, the run its verified step keeps, the commit it queues for the allocator)."""

from __future__ import annotations

from actors.scheduler.batch import PrefillWork, StepOutbox
from actors.scheduler.core import SchedulerCore
from actors.scheduler.policy import NewTokenRatio, Policy, SchedulerLimits
from actors.speculation.policy import (
    MAX_PAUSE,
    MISS_LIMIT,
    DraftBackoff,
    SpeculationConfig,
    SpeculationStats,
    draft_budget,
)
from transport.messages.alloc import ExtendGrantItem, ReleaseKind, SlotDeltas
from transport.messages.engine import FinishReason, NewRequest
from transport.messages.params import GenerationParams
from transport.messages.runner import StepResultMsg

LIMITS = SchedulerLimits(
    page_size=4, row_capacity=64, max_running=8, max_batch_tokens=64, chunk_size=64
)
REPEATING = [5, 6, 7, 8, 9] * 4  # prompt lookup drafts 5 6 7 8 ... after any tail


def test_draft_budget_stays_inside_max_tokens_and_the_row():
    assert draft_budget(4, remaining_new=100, committed=10, row_capacity=64) == 4
    assert draft_budget(4, remaining_new=3, committed=10, row_capacity=64) == 2
    assert draft_budget(4, remaining_new=1, committed=10, row_capacity=64) == 0
    assert draft_budget(4, remaining_new=100, committed=61, row_capacity=64) == 2
    assert draft_budget(4, remaining_new=100, committed=63, row_capacity=64) == 0


def test_backoff_pauses_after_misses_doubling_and_resets_on_acceptance():
    b = DraftBackoff()
    pauses = []
    for _ in range(8):
        for _ in range(MISS_LIMIT):
            assert b.ready()
            b.observe(proposed=4, accepted=0)
        pauses.append(b.pause)
        while b.pause:
            assert not b.ready()
    assert pauses == [1, 2, 4, 8, 16, 32, 64, 64] and MAX_PAUSE == 64
    b.observe(proposed=0, accepted=0)  # a step without drafts counts for nothing
    assert b.ready()
    b.observe(proposed=4, accepted=1)
    assert (b.misses, b.next_pause) == (0, 1)


def test_stats_count_drafts_tokens_and_acceptance_by_position():
    s = SpeculationStats()
    s.observe(4, 2)
    s.observe(2, 2)
    s.observe(0, 0)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (2, 6, 4)
    assert s.accepted_per_position == [2, 2, 0, 0]


def core(**spec) -> SchedulerCore:
    config = SpeculationConfig(**{"method": "ngram", **spec})
    return SchedulerCore(
        LIMITS, policy_name=Policy.FCFS, ratio=NewTokenRatio(0.5, 0.1), speculation=config
    )


def running(c: SchedulerCore, rid: int, prompt: list[int], first: int = 5, **params):
    """Submit `rid`, prefill its whole prompt and fold in its first token."""
    c.submit(
        [NewRequest(rid=rid, prompt_ids=prompt, params=GenerationParams(**params), eos_ids=[2])]
    )
    [chunk] = c.admissions(64, _kv())
    [work] = c.apply_grants(
        [chunk],
        [ExtendGrantItem(rid=rid, row=rid, cached_len=0, start=0, end=len(prompt))],
        SlotDeltas(),
    )
    c.apply_results([], [work], StepResultMsg(step=1, rids=[rid], tokens=[first]), StepOutbox())
    assert c.reqs[rid].output_ids == [first]
    return c.reqs[rid]


def _kv():
    from tests.unit.test_scheduler_policy import kv

    return kv(free=100)


def test_a_drafting_request_verifies_commits_its_kept_run_and_cuts_at_eos():
    c = core(num_speculative_tokens=4, prompt_lookup_min=1)
    r = running(c, 1, REPEATING, max_tokens=50)
    assert r.committed == len(REPEATING) and r.tokens[-1] == 5
    assert c.plan_drafts([r]) == [4] and r.draft == [6, 7, 8, 9]
    c.on_decode_granted([r], SlotDeltas())
    assert r.committed == len(REPEATING)  # reserved, not committed
    batch = c.build_batch([r], [])
    assert batch.prefix_lens == [len(REPEATING)] and batch.extend_lens == [5]
    assert batch.input_ids == [5, 6, 7, 8, 9] and batch.draft_lens == [4]
    out = StepOutbox()
    # Two drafts accepted, then a correction: three tokens, three positions committed.
    c.apply_results([r], [], StepResultMsg(step=2, rids=[1], tokens=[6, 7, 11], counts=[3]), out)
    assert r.output_ids == [5, 6, 7, 11] and r.committed == len(REPEATING) + 3
    assert [(x.rid, x.accepted) for x in c.take_commits()] == [(1, 3)]
    assert [t.token for t in out.reports[-1].tokens] == [6, 7, 11]
    stats = c.stats()
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (1, 4, 2)
    assert stats.generated_tokens == 4
    # The next step decodes plainly (nothing followed "11" before).
    assert c.plan_drafts([r]) == []
    c.on_decode_granted([r], SlotDeltas())
    assert r.committed == len(REPEATING) + 4
    c.apply_results([r], [], StepResultMsg(step=3, rids=[1], tokens=[5]), StepOutbox())
    assert not c.take_commits()
    # EOS inside the next accepted run: the request ends there and commits what it kept.
    assert c.plan_drafts([r]) == [4] and r.draft == [6, 7, 11, 5]  # after the last "5"
    c.on_decode_granted([r], SlotDeltas())
    out = StepOutbox()
    c.apply_results([r], [], StepResultMsg(step=4, rids=[1], tokens=[6, 2, 9], counts=[3]), out)
    assert r.output_ids[-2:] == [6, 2] and 1 not in c.reqs
    assert [(x.rid, x.accepted) for x in c.take_commits()] == [(1, 2)]
    [release] = out.releases
    assert release.kind is ReleaseKind.FINISH and release.tokens == r.tokens
    assert out.reports[-1].finish == FinishReason.STOP


def test_drafts_respect_max_tokens_batch_size_and_the_opt_out():
    c = core(num_speculative_tokens=8, max_batch=2)
    near_end = running(c, 1, REPEATING, max_tokens=3)  # 2 left after its first token
    assert c.plan_drafts([near_end]) == [1]  # the step emits at most 1 + 1
    opted_out = running(c, 2, REPEATING, max_tokens=50, speculate=False)
    assert c.plan_drafts([opted_out]) == []
    seeded = running(c, 4, REPEATING, max_tokens=50, temperature=0.7, seed=3)
    assert c.plan_drafts([seeded]) == []  # its tokens must not depend on the batch
    unseeded = running(c, 5, REPEATING, max_tokens=50, temperature=0.7)
    greedy_seeded = running(c, 6, REPEATING, max_tokens=50, temperature=0.0, seed=3)
    assert all(c.plan_drafts([unseeded, greedy_seeded]))
    third = running(c, 3, REPEATING, max_tokens=50)
    assert c.plan_drafts([near_end, opted_out, third]) == []  # above max_batch: nobody
    assert not near_end.draft and not third.draft
    off = SchedulerCore(LIMITS, policy_name=Policy.FCFS, ratio=NewTokenRatio(0.5, 0.1))
    assert not off.speculator.enabled
    r = running(off, 9, REPEATING, max_tokens=50)
    assert off.plan_drafts([r]) == [] and off.build_batch([r], []).draft_lens == []


def test_an_aborted_drafting_request_releases_without_a_commit():
    c = core()
    r = running(c, 1, REPEATING, max_tokens=50)
    c.plan_drafts([r])
    c.on_decode_granted([r], SlotDeltas())
    c.end([1], FinishReason.ABORT)
    out = StepOutbox()
    c.apply_ends(out)  # the step never ran: its reservation is freed by the abort
    assert [i.kind for i in out.releases] == [ReleaseKind.ABORT] and not c.take_commits()
    assert not r.draft


def test_prefill_chunks_share_the_budget_with_drafts():
    c = core(num_speculative_tokens=4)
    r = running(c, 1, REPEATING, max_tokens=50)
    c.plan_drafts([r])
    c.submit(
        [NewRequest(rid=2, prompt_ids=list(range(100)), params=GenerationParams(), eos_ids=[2])]
    )
    assert c.prefill_budget(decode_tokens=1 + len(r.draft)) == 64 - 5
    assert PrefillWork(r, 0, 1).end == 1


def test_a_shared_drafter_learns_the_tail_of_a_long_output_only():
    from types import SimpleNamespace

    from actors.speculation.policy import LEARN_MAX_TOKENS, Speculator

    sp = Speculator(SpeculationConfig(method="suffix"))
    early = list(range(1000, 1050))
    output = early + [7, 8, 9] * (LEARN_MAX_TOKENS // 3 + 1)
    shared = SimpleNamespace(cache_salt="", speculate=True)
    done = SimpleNamespace(rid=1, prompt_ids=[1, 2, 3], tokens=[1, 2, 3, *output], params=shared)
    sp.finished(done, learn=True)
    assert sp.drafter.propose(2, [50, 7, 8], 3) == [9, 7, 8]  # learned: the tail
    assert sp.drafter.propose(3, [50, 1000, 1001], 3) == []  # not learned: past the cap
    aborted = SimpleNamespace(rid=4, prompt_ids=[1], tokens=[1, 60, 61, 62, 60, 61], params=shared)
    sp.finished(aborted, learn=False)
    assert sp.drafter.propose(5, [70, 60, 61], 2) == []


def test_salted_requests_neither_teach_nor_draft_from_other_requests():
    from types import SimpleNamespace

    c = core(method="suffix")
    salted = SimpleNamespace(cache_salt="tenant-a", speculate=True)
    secret = SimpleNamespace(rid=1, prompt_ids=[1], tokens=[1, 80, 81, 82, 83], params=salted)
    c.speculator.finished(secret, learn=True)
    assert c.speculator.drafter.propose(2, [9, 80, 81], 2) == []  # not learned
    public = SimpleNamespace(cache_salt="", speculate=True)
    c.speculator.finished(
        SimpleNamespace(rid=3, prompt_ids=[1], tokens=[1, 90, 91, 92, 93], params=public),
        learn=True,
    )
    plain = running(c, 4, [7, 90, 91], first=92, max_tokens=50)  # drafts from request 3
    assert c.plan_drafts([plain]) and plain.draft[0] == 93
    other = running(c, 5, [7, 90, 91], first=92, max_tokens=50, cache_salt="tenant-b")
    assert c.plan_drafts([other]) == []  # its own tokens only: nothing recurs


def test_the_draft_width_doubles_while_every_draft_is_accepted_and_resets_on_a_rejection():
    c = core(num_speculative_tokens=2, max_speculative_tokens=8)
    document = list(range(100, 140))
    r = running(c, 1, [*document, *document[:4]], first=104, max_tokens=200)  # a copy
    widths = []
    for accepted_all in (True, True, True, True, False, True):
        c.plan_drafts([r])
        widths.append(len(r.draft))
        c.speculator.observe(r, len(r.draft), len(r.draft) if accepted_all else 0)
        r.draft = []
    assert widths == [2, 4, 8, 8, 8, 2]
