"""The scheduler's state and bookkeeping, synchronous: queues, counters, and step plans.

`SchedulerCore` owns the waiting queue, the prefilling and running sets and the step's
bookkeeping; its methods apply the policy (`actors.scheduler.policy`) and the allocator's and
runner's replies to that state. It never sends or awaits: `SchedulerActor` calls it between
its messages, and the policy tests drive it directly with plain data.

A request is in exactly one of `waiting`, `prefilling` (admitted, prompt not fully in KV)
and `running` (decoding) while it is in `reqs`; it leaves `reqs` when it finishes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from actors.scheduler import policy
from actors.scheduler.batch import PrefillWork, StepOutbox, forward_batch, sampled_tokens
from actors.scheduler.policy import Chunk, NewTokenRatio, Policy, SchedulerLimits
from actors.scheduler.request import Req
from actors.scheduler.stats import StepTokenHistogram
from actors.speculation.policy import SpeculationConfig, Speculator
from transport.messages.alloc import (
    DraftCommit,
    ExtendGrantItem,
    KvStats,
    ReleaseItem,
    ReleaseKind,
    SlotDeltas,
)
from transport.messages.engine import FinishReason, NewRequest, SchedulerStats
from transport.messages.runner import ForwardBatchMsg, StepResultMsg

# What a client is told when its request had no token yet and the pool could not hold it
# even with nothing else running (not a runner failure: retrying it may succeed).
KV_SHORT_TEXT = (
    "the KV cache had no room for this request even with nothing else running (its prompt "
    "and max_tokens need more pages than were free); retry it later, or shorten it"
)


class DuplicateRequest(ValueError):
    """A request id that is already scheduled: it would share the first one's KV."""


@dataclass(slots=True)
class SchedulerCounters:
    decode_steps: int = 0
    retractions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    pure_decode_steps: int = 0  # decode steps with no admission, finish or end
    pure_decode_messages: int = 0  # messages the scheduler sent during those steps
    runner_ms: float = 0.0  # the runner's own time in its steps (forward + sampling)
    step_tokens: StepTokenHistogram = field(default_factory=StepTokenHistogram)  # per forward


class SchedulerCore:
    def __init__(
        self,
        limits: SchedulerLimits,
        *,
        policy_name: Policy = Policy.FCFS,
        ratio: NewTokenRatio,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        self.limits = limits
        self.policy = Policy(policy_name)
        self.ratio = ratio
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.reqs: dict[int, Req] = {}
        self.pending_ends: dict[int, FinishReason] = {}
        self.unregister: list[int] = []  # sampler states the runner may drop
        self.carry_deltas: list[SlotDeltas] = []  # row rewrites to ship with the next batch
        self.speculator = Speculator(speculation or SpeculationConfig())
        # Speculative steps' accepted positions, for the allocator's next AllocDecode or
        # ReleaseBatch (whichever goes first; it applies them before anything else)
        self.pending_commits: list[DraftCommit] = []
        self.step_no = 0
        self.counters = SchedulerCounters()

    # ---- arrivals and ends ---------------------------------------------------------------
    def submit(self, new: Sequence[NewRequest]) -> None:
        """Queue new requests; all or none: a rid already scheduled (or twice in `new`)
        raises `DuplicateRequest` and queues nothing."""
        rids = [n.rid for n in new]
        twice = sorted({r for r in rids if r in self.reqs or rids.count(r) > 1})
        if twice:
            raise DuplicateRequest(f"request ids {twice[:8]} are already scheduled")
        now = time.monotonic()
        for n in new:
            p = n.params
            req = Req(
                rid=n.rid,
                prompt_ids=list(n.prompt_ids),
                params=p,
                eos_ids=frozenset(() if p.ignore_eos else n.eos_ids),
                stop_ids=frozenset(p.stop_token_ids),
                arrived_at=now,
                session_id=n.session_id,
                grammar_key=n.grammar_key,
            )
            self.reqs[req.rid] = req
            self.waiting.append(req)

    def end(self, rids: Sequence[int], reason: FinishReason) -> None:
        """Ask to end these requests at the next safe point (unknown rids are ignored)."""
        for rid in rids:
            if rid in self.reqs:
                self.pending_ends.setdefault(rid, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.pending_ends)

    def on_idle(self) -> None:
        self.ratio.reset()

    def apply_ends(self, out: StepOutbox) -> None:
        ends, self.pending_ends = self.pending_ends, {}
        for rid, reason in ends.items():
            req = self.reqs.get(rid)
            if req is not None:
                self._remove(req)
                self.finish(req, reason, out)

    def finish(
        self, req: Req, reason: FinishReason, out: StepOutbox, tokens=(), error: str = ""
    ) -> None:
        """Record the end of a request (already out of the queues); its KV release goes in
        `out`, with its last tokens and finish reason in the token report (`error`: what
        the client is told of an ERROR that is not its runner's failure)."""
        del self.reqs[req.rid]
        # Only a request that ended well leaves its KV to the prefix cache (and its output
        # to a shared drafter).
        cache = reason not in (FinishReason.ABORT, FinishReason.ERROR)
        self.speculator.finished(req, learn=cache)
        req.draft = []
        if req.admitted:
            out.releases.append(
                ReleaseItem(
                    rid=req.rid,
                    kind=ReleaseKind.FINISH if cache else ReleaseKind.ABORT,
                    tokens=req.tokens if cache else [],
                )
            )
            req.admitted = False
        elif req.retractions:
            # A retracted request keeps an empty record at the allocator: drop it.
            out.releases.append(ReleaseItem(rid=req.rid, kind=ReleaseKind.ABORT))
        if req.registered:
            self.unregister.append(req.rid)
        out.report(req, tokens, reason, error)

    def _remove(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.running:
            self.running.remove(req)

    def fail_all(self, out: StepOutbox) -> int:
        """End every request with ERROR (the runner lost their KV): KV released uncached,
        and nothing left for the runner (it is a fresh instance); how many ended."""
        reqs = list(self.reqs.values())
        for req in reqs:
            self._remove(req)
            self.finish(req, FinishReason.ERROR, out)
        self.pending_ends.clear()
        self.carry_deltas.clear()
        self.unregister.clear()
        return len(reqs)

    def fail_step(
        self,
        batch: ForwardBatchMsg,
        decode: Sequence[Req],
        prefill: Sequence[PrefillWork],
        out: StepOutbox,
    ) -> int:
        """The runner failed this step as a whole: end its requests with ERROR (KV released
        uncached, the allocator's abort path) and nothing else; how many ended.

        The runner may or may not have applied the batch's slot deltas, and they may name
        rows of requests not in it (cache-unfinished rewrites): they go again, first, with
        the next batch. Row writes are overwrites, so applying them twice changes nothing.
        Registered sampler states of the failed requests are dropped by `finish`."""
        self.carry_deltas.insert(0, batch.deltas)
        reqs = [*decode, *(w.req for w in prefill)]
        for req in reqs:
            self._fail(req, out)
        return len(reqs)

    def _fail(self, req: Req, out: StepOutbox) -> None:
        if req.rid in self.reqs:
            self._remove(req)
            self.pending_ends.pop(req.rid, None)
            self.finish(req, FinishReason.ERROR, out)

    def cut_short(self, req: Req, out: StepOutbox) -> None:
        """The pool cannot hold `req` even alone: it ends with what it has ("length"), or
        with an error when it has no token yet (a 200 with no tokens is no answer)."""
        self._remove(req)
        if req.output_ids:
            self.finish(req, FinishReason.LENGTH, out)
        else:
            self.finish(req, FinishReason.ERROR, out, error=KV_SHORT_TEXT)

    # ---- decode ----------------------------------------------------------------------------
    def plan_drafts(self, decode: Sequence[Req]) -> list[int]:
        """This step's draft tokens per decode request (`req.draft`), as counts for
        `AllocDecode` ([] when nobody drafts)."""
        if not self.speculator.plan(
            list(decode), self.limits.row_capacity, self.limits.max_batch_tokens
        ):
            return []
        return [len(r.draft) for r in decode]

    def drop_drafts(self, decode: Sequence[Req]) -> None:
        for req in decode:
            req.draft = []

    def take_commits(self) -> list[DraftCommit]:
        commits, self.pending_commits = self.pending_commits, []
        return commits

    def on_decode_granted(self, decode: Sequence[Req], deltas: SlotDeltas) -> None:
        """Slots granted: a request without drafts committed its step's position already;
        one with drafts commits after verification (`apply_results`)."""
        for req in decode:
            if not req.draft:
                req.committed += 1
        self.carry_deltas.append(deltas)
        self.counters.decode_steps += 1
        self.ratio.decay()

    def retract_item(self, victim: Req) -> ReleaseItem:
        return ReleaseItem(rid=victim.rid, kind=ReleaseKind.RETRACT, tokens=victim.tokens)

    def on_retracted(self, victim: Req) -> None:
        """The allocator released `victim`'s KV (its prefix cached): it waits at the front."""
        self._remove(victim)
        victim.admitted = False
        victim.committed = 0
        victim.retractions += 1
        self.waiting.appendleft(victim)
        self.counters.retractions += 1
        self.ratio.after_retraction(self.running)

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_budget(self, decode_tokens: int) -> int:
        """Prefill tokens this step may compute besides `decode_tokens` (drafts included)."""
        if not (self.prefilling or self.waiting):
            return 0
        return max(self.limits.max_batch_tokens - decode_tokens, 0)

    def continuing_chunks(self, budget: int) -> list[Chunk]:
        return policy.continuing_chunks(self.prefilling, budget, self.limits.chunk_size)

    def ready(self) -> list[Req]:
        """The waiting requests that may be admitted now (not waiting for a read-ahead)."""
        return [r for r in self.waiting if not r.staging]

    def unstick(self) -> policy.Retract | policy.CutShort | None:
        """Nothing could run this step: what frees the engine (a turn waiting for its
        read-ahead is not stuck)."""
        return policy.unstick(self.running, self.prefilling, self.ready())

    def wants_admission(self, budget: int) -> bool:
        slots = self.limits.max_running - len(self.running) - len(self.prefilling)
        ready = any(not r.staging for r in self.waiting)
        return ready and budget > 0 and slots > 0

    def admissions(
        self, budget: int, kv: KvStats, cached_lens: Sequence[int] | None = None
    ) -> list[Chunk]:
        """First chunks of the waiting requests admitted under `kv` and `budget`."""
        order = policy.admission_order(list(self.waiting), cached_lens)
        order = [r for r in order if not r.staging]
        picked = policy.admit(
            order, [*self.running, *self.prefilling], kv, budget, self.limits, self.ratio.value
        )
        return policy.first_chunks(picked, budget, self.limits.chunk_size)

    def apply_grants(
        self, chunks: Sequence[Chunk], grants: Sequence[ExtendGrantItem], deltas: SlotDeltas
    ) -> list[PrefillWork]:
        self.carry_deltas.append(deltas)
        work = []
        for chunk, g in zip(chunks, grants):
            req = chunk.req
            if g.row < 0:
                continue  # refused: no KV now; stays where it was
            if not req.admitted:
                req.admitted = True
                self.waiting.remove(req)
                self.prefilling.append(req)
                if req.cached_tokens < 0:
                    req.cached_tokens = g.cached_len
                    req.queued_s = time.monotonic() - req.arrived_at
                    self.counters.cached_tokens += g.cached_len
            req.committed = g.end
            req.row = g.row
            self.counters.prompt_tokens += g.end - g.start
            work.append(PrefillWork(req, g.start, g.end))
        return work

    # ---- the forward and its results -------------------------------------------------------
    def build_batch(self, decode: Sequence[Req], prefill: Sequence[PrefillWork]) -> ForwardBatchMsg:
        self.step_no += 1
        self.counters.step_tokens.observe(
            sum(1 + len(r.draft) for r in decode) + sum(w.end - w.start for w in prefill)
        )
        deltas, self.carry_deltas = self.carry_deltas, []
        unregister, self.unregister = self.unregister, []
        batch, new = forward_batch(self.step_no, decode, prefill, deltas, unregister)
        for req in new:
            req.registered = True
        return batch

    def apply_results(
        self,
        decode: Sequence[Req],
        prefill: Sequence[PrefillWork],
        result: StepResultMsg,
        out: StepOutbox,
    ) -> list[Req]:
        """Fold the sampled tokens in; returns requests whose prefill is still unfinished.
        Requests the runner could not serve (`failed_rids`) end with ERROR here."""
        sampled = sampled_tokens(result)
        self.counters.runner_ms += result.forward_ms
        out.prompt_logprobs(result, {w.req.rid: w for w in prefill})
        failed = set(result.failed_rids)
        for req in [*decode, *(w.req for w in prefill)]:
            if req.rid in failed:
                self._fail(req, out)
        unfinished: list[Req] = []
        for work in prefill:
            req = work.req
            if req.rid in failed:
                continue
            if not work.is_last_chunk:
                unfinished.append(req)
            elif req in self.prefilling:
                self.prefilling.remove(req)
                self.running.append(req)
        for req in [*decode, *(w.req for w in prefill)]:
            emitted = sampled.get(req.rid)
            if emitted is None or req.rid in failed:
                continue
            kept, reason = [], None
            for s in emitted:  # a speculative step's run is cut where the request ends
                req.output_ids.append(s.token)
                kept.append(s)
                reason = policy.finish_reason(req, s.token, self.limits.row_capacity)
                if reason is not None:
                    break
            self.counters.generated_tokens += len(kept)
            if req.draft:
                # KV holds the step's input and the accepted drafts; what the request keeps
                # of them is committed (its last kept token's KV is the next step's work).
                self.speculator.observe(req, len(req.draft), len(emitted) - 1)
                self.pending_commits.append(DraftCommit(rid=req.rid, accepted=len(kept)))
                req.committed += len(kept)
                req.draft = []
            if reason is None:
                out.report(req, kept)
            else:
                self.running.remove(req)
                self.finish(req, reason, out, kept)
        return unfinished

    def defer_deltas(self, deltas: SlotDeltas) -> None:
        """Row rewrites (cache-unfinished) that the runner must apply before the next step."""
        self.carry_deltas.append(deltas)

    # ---- telemetry -------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        c, spec = self.counters, self.speculator.stats
        return SchedulerStats(
            waiting=len(self.waiting),
            running=len(self.running),
            prefilling=len(self.prefilling),
            steps=self.step_no,
            decode_steps=c.decode_steps,
            retractions=c.retractions,
            prompt_tokens=c.prompt_tokens,
            generated_tokens=c.generated_tokens,
            cached_tokens=c.cached_tokens,
            new_token_ratio=self.ratio.value,
            pure_decode_steps=c.pure_decode_steps,
            pure_decode_messages=c.pure_decode_messages,
            runner_busy_s=c.runner_ms / 1e3,
            step_tokens_bounds=list(c.step_tokens.bounds),
            step_tokens_buckets=c.step_tokens.cumulative(),
            step_tokens_sum=c.step_tokens.sum,
            step_tokens_count=c.step_tokens.count,
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )
