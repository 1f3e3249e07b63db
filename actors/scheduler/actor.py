"""The scheduler actor: the step loop that turns `SchedulerCore`'s plans into messages.

Each step (continuous batching under a token budget):
  1. apply pending ends (aborts, stop strings) at this safe point; their KV goes back
     before anything of this step is allocated (releases are sent ahead of every
     allocating call, so no "cannot fit" rule fires on pages that are being freed);
  2. decode: every running request gets one slot, and a drafting one slots for its draft
     tokens (`AllocDecode`, all or nothing, carrying the last step's draft commits); on a
     shortfall the drafts go first, then a victim is retracted (its computed prefix goes
     to the tree) and the call retried;
  3. prefill: continuing chunks first, then admissions (`KvStatsRequest`, and `PeekPrefix`
     for longest-prefix-match) under the remaining budget, in one `AllocExtend`;
  4. one `ForwardBatchMsg` to the runner, carrying every slot delta the allocator returned;
  5. finished requests released in one `ReleaseBatch`, non-final chunks cached in one
     `CacheUnfinished`; the step's `TokenBatch` for the tokenizer is held until the next
     step's `ForwardBatchMsg` is on its way (or the loop has no next forward), so
     detokenization and streaming of step N overlap the runner's step N + 1 instead of
     delaying its start. Nothing of step N + 1 depends on the report: every decision it
     needs (finishes by length, EOS, stop ids) the scheduler has made already.
When the engine goes idle it asks the allocator for a conservation check (`IdleCheck`).

With a disk tier, a session's turn waits out of the admission order while the allocator
has its KV read ahead from disk (`StageSlot`, answered once the runner read and verified
the file beside its steps); the other requests run meanwhile, and the turn's admission
then loads from memory.

When the runner answers a step with an error (its step raised: out of memory, a batch it
could not decode, ...), that step failed, not the engine: the step's requests end with
finish reason "error" (their KV released uncached, the allocator's abort path) and every
other request goes on. A request the runner reports in `failed_rids` (its grammar is not
loaded) ends the same way, alone.

When the runner crashes (`PeerCrashed` from the system), the step waiting on it is given
up: every request ends with finish reason "error" (its client sees an error), its KV is
released uncached, the prefix tree is dropped (`DropCache`: the KV it names is gone) and
checked idle, and stepping resumes once the restarted runner answers a ping.
A decode step with no admission and no finish costs three messages whatever the batch size:
AllocDecode (call), ForwardBatchMsg (call), TokenBatch (send).
"""

from __future__ import annotations

import anyio

from actors.runtime import Actor, HandledError, RemoteError
from actors.scheduler.batch import PrefillWork, StepOutbox
from actors.scheduler.core import DuplicateRequest, SchedulerCore
from actors.scheduler.policy import (
    CutShort,
    NewTokenRatio,
    Policy,
    Retract,
    SchedulerLimits,
    on_decode_shortfall,
)
from actors.scheduler.request import Req
from actors.speculation.policy import SpeculationConfig
from kvcore.salt import salted_tokens
from transport.channel import ChannelClosed
from transport.messages.alloc import (
    AllocDecode,
    AllocDecodeReply,
    AllocExtend,
    AllocExtendReply,
    CacheUnfinished,
    CacheUnfinishedReply,
    DropCache,
    DropCacheReply,
    ExtendItem,
    IdleCheck,
    IdleCheckReply,
    KvStats,
    KvStatsRequest,
    ReleaseBatch,
    StageSlot,
    StageSlotReply,
)
from transport.messages.control import PeerCrashed
from transport.messages.engine import (
    EndRequests,
    SchedulerStatsRequest,
    SubmitRequests,
    TokenBatch,
)
from transport.messages.radix import PeekPrefix, PeekReply
from transport.messages.runner import StepResultMsg

STAGE_TIMEOUT_S = 30.0  # a turn waits this long at most for its KV's read-ahead


class RunnerLost(Exception):
    """The runner crashed while (or before) computing this step."""


class StepFailed(Exception):
    """The runner answered this step with an error: the step's requests fail, nothing else."""


class SchedulerActor(Actor):
    inbox = SubmitRequests | EndRequests | SchedulerStatsRequest | PeerCrashed

    def __init__(
        self,
        page_size: int,
        row_capacity: int,
        max_running_requests: int = 64,
        max_batch_tokens: int = 2048,
        chunk_size: int = 512,
        policy: str = "fcfs",
        radix: bool = True,
        new_token_ratio: float = 0.7,
        min_new_token_ratio: float = 0.1,
        ratio_decay_steps: int = 600,
        runner_timeout_s: float = 600.0,
        sliding_window: int = 0,
        speculative: dict | None = None,
        stage_sessions: bool = False,  # the allocator has a disk tier: read turns' KV ahead
    ) -> None:
        if policy not in tuple(Policy):
            raise ValueError(f"policy must be 'fcfs' or 'lpm', got {policy!r}")
        limits = SchedulerLimits(
            page_size=page_size,
            row_capacity=row_capacity,
            max_running=max_running_requests,
            max_batch_tokens=max_batch_tokens,
            chunk_size=chunk_size,
            sliding_window=sliding_window,
        )
        ratio = NewTokenRatio(new_token_ratio, min_new_token_ratio, ratio_decay_steps)
        self.core = SchedulerCore(
            limits,
            policy_name=Policy(policy),
            ratio=ratio,
            speculation=SpeculationConfig(**(speculative or {})),
        )
        self.radix = radix
        self.stage_sessions = stage_sessions
        # The disk tier held sessions at the last KvStats (unknown at start: a restart
        # may have brought sessions back there).
        self.disk_entries = True
        self.runner_timeout_s = runner_timeout_s
        self.wake = anyio.Event()
        self.step_messages = 0  # messages this scheduler sent during the current step
        self.tried_admission = False  # this step asked for KV stats to admit from the queue
        self.runner_lost: str | None = None  # why, from the runner's crash until it is back
        self._forward_scope: anyio.CancelScope | None = None  # the runner call in flight
        self._report: TokenBatch | None = None  # the last step's token report, not yet sent
        self.runner_failures = 0

    # ---- mailbox -------------------------------------------------------------------------
    async def on_start(self) -> None:
        self.alloc = self.ref("allocator")
        self.runner = self.ref("runner")
        self.tokenizer = self.ref("tokenizer")
        self.radix_ref = self.ref("radix") if self.radix else None
        self.spawn(self._loop)

    async def handle(self, msg, sender):
        if isinstance(msg, SubmitRequests):
            try:
                self.core.submit(msg.reqs)
            except DuplicateRequest as exc:
                raise HandledError(str(exc)) from None
            if self.stage_sessions and self.disk_entries:
                for new in msg.reqs:
                    if new.session_id:
                        self._stage(self.core.reqs[new.rid])
        elif isinstance(msg, EndRequests):
            self.core.end(msg.rids, msg.reason)
        elif isinstance(msg, SchedulerStatsRequest):
            return self.core.stats()
        elif isinstance(msg, PeerCrashed):
            if msg.actor == "runner" and sender.sender == "system":
                self.log.error("runner crashed", error=msg.error, restarting=msg.will_restart)
                self.runner_lost = msg.error
                if self._forward_scope is not None:
                    self._forward_scope.cancel()  # its reply will never come
        self.wake.set()
        return None

    def _stage(self, req: Req) -> None:
        """A session's turn waits (others run) while the allocator has its KV read ahead
        from the disk tier, so the admission's load copies from memory; at most
        STAGE_TIMEOUT_S, after which the load reads the file itself."""
        req.staging = True

        async def stage() -> None:
            try:
                with anyio.move_on_after(STAGE_TIMEOUT_S):
                    await self.alloc.call(
                        StageSlot(session_id=req.session_id),
                        expect=StageSlotReply,
                        timeout=STAGE_TIMEOUT_S,
                    )
            except Exception as exc:  # noqa: BLE001 - the turn goes on: its load reads the file
                self.log.warning("a turn's read-ahead failed", error=repr(exc)[:300])
            finally:
                req.staging = False
                self.wake.set()

        self.spawn(stage)

    def stats(self) -> dict[str, int | float]:
        core = self.core
        return {
            "waiting": len(core.waiting),
            "running": len(core.running) + len(core.prefilling),
            "steps": core.step_no,
            "retractions": core.counters.retractions,
            "generated_tokens": core.counters.generated_tokens,
            "runner_failures": self.runner_failures,
        }

    async def _call(self, ref, msg, **kw):
        self.step_messages += 1
        return await ref.call(msg, **kw)

    # ---- the step loop -------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if self.runner_lost is not None:
                await self._recover_from_runner_crash()
                continue
            if not self.core.has_work:
                await self._send_report()  # no next forward to wait for
                self.wake = anyio.Event()
                self.core.on_idle()
                await self.alloc.call(IdleCheck(), expect=IdleCheckReply)
                if not self.core.has_work and self.runner_lost is None:
                    await self.wake.wait()
                if self.runner_lost is not None:
                    continue
            try:
                progressed = await self.step()
            except RunnerLost:
                continue
            if not progressed:
                # Nothing could run (e.g. waiting for KV held by nobody we can retract).
                await self._send_report()
                self.wake = anyio.Event()
                with anyio.move_on_after(0.05):
                    await self.wake.wait()

    async def step(self) -> bool:
        core = self.core
        out = StepOutbox()
        self.step_messages = 0
        self.tried_admission = False
        retractions = core.counters.retractions
        core.apply_ends(out)
        await self._send_releases(out)
        decode = await self._schedule_decode(out)
        prefill = await self._schedule_prefill(sum(1 + len(r.draft) for r in decode), out)
        if not decode and not prefill:
            action = core.unstick()
            if isinstance(action, Retract):
                await self._retract(action.victim)
            elif isinstance(action, CutShort):
                await self._log_cut_short(action.req, "nothing could run")
                core.cut_short(action.req, out)
            await self._send_report()  # the previous step's report goes first
            await self._flush(out)
            return bool(out.reports) or action is not None
        batch = core.build_batch(decode, prefill)
        try:
            result = await self._forward(batch)
        except StepFailed as exc:
            self.runner_failures += 1
            ended = core.fail_step(batch, decode, prefill, out)
            self.log.error("runner step failed; its requests end", ended=ended, error=str(exc))
            await self._flush(out, hold_report=True)
            return True
        unfinished = core.apply_results(decode, prefill, result, out)
        if unfinished:
            reply = await self._call(
                self.alloc,
                CacheUnfinished(
                    rids=[r.rid for r in unfinished], tokens=[r.tokens for r in unfinished]
                ),
                expect=CacheUnfinishedReply,
            )
            core.defer_deltas(reply.deltas)
        await self._flush(out, hold_report=True)
        pure = (
            not prefill
            and not out.released
            and not self.tried_admission
            and retractions == core.counters.retractions
            and not out.any_finish
        )
        if pure:
            # A decode step with no admission, no finish, no end: its cost is constant.
            core.counters.pure_decode_steps += 1
            core.counters.pure_decode_messages += self.step_messages
        return True

    async def _forward(self, batch) -> StepResultMsg:
        """The runner's step; `RunnerLost` when it crashed before answering, `StepFailed`
        when it answered with an error (the runner serves on; only this step is lost)."""
        failure: RemoteError | None = None
        if self.runner_lost is None:
            with anyio.CancelScope() as self._forward_scope:
                try:
                    async with anyio.create_task_group() as tg:
                        # The call sends the batch before its first wait, so the report
                        # (the previous step's tokens) follows the batch to the runner.
                        tg.start_soon(self._send_report)
                        try:
                            return await self._call(
                                self.runner,
                                batch,
                                expect=StepResultMsg,
                                timeout=self.runner_timeout_s,
                            )
                        except RemoteError as exc:
                            failure = exc
                finally:
                    self._forward_scope = None
        if failure is not None and self.runner_lost is None:
            raise StepFailed(str(failure))
        raise RunnerLost(self.runner_lost)

    async def _recover_from_runner_crash(self) -> None:
        """End every request with an error, drop the prefix cache (its KV went with the
        runner), check that the pool is whole, then wait for the runner to be back."""
        reason = self.runner_lost
        self.runner_failures += 1
        await self._send_report()  # tokens computed before the crash still reach clients
        out = StepOutbox()
        ended = self.core.fail_all(out)
        await self._flush(out)
        reply = await self.alloc.call(DropCache(), expect=DropCacheReply)
        if reply.problems:
            # The accounting is wrong, not just the runner: stop rather than serve on it.
            raise RuntimeError("KV not whole after the runner crash: " + "; ".join(reply.problems))
        self.log.warning(
            "requests ended after a runner crash",
            ended=ended,
            dropped_cache_pages=reply.dropped_pages,
            error=reason,
        )
        with anyio.fail_after(self.runner_timeout_s):
            while True:
                try:
                    await self.runner.ping(timeout=1.0)
                    break
                except (TimeoutError, ChannelClosed, RemoteError):
                    await anyio.sleep(0.1)
        if self.runner_lost == reason:
            self.runner_lost = None  # else it crashed again meanwhile: recover once more
        self.log.info("runner back; scheduling again")
        self.wake.set()

    async def _schedule_decode(self, out: StepOutbox) -> list[Req]:
        core = self.core
        decode = list(core.running)
        drafts = core.plan_drafts(decode)
        while decode:
            await self._send_releases(out)
            reply = await self._call(
                self.alloc,
                AllocDecode(
                    rids=[r.rid for r in decode], drafts=drafts, commits=core.take_commits()
                ),
                expect=AllocDecodeReply,
            )
            if reply.short_pages == 0:
                core.on_decode_granted(decode, reply.deltas)
                return decode
            # Refused (nothing allocated), but the reply may carry unmappings of pages the
            # releases just before it freed: the runner must still hear them.
            core.carry_deltas.append(reply.deltas)
            if drafts:
                # Draft slots are the first thing to give up under pressure.
                core.drop_drafts(decode)
                drafts = []
                continue
            action = on_decode_shortfall(decode, core.prefilling)
            if isinstance(action, CutShort):
                # Even alone it cannot grow: the pool is too small for this context.
                decode.remove(action.req)
                await self._log_cut_short(action.req, "decode slot short")
                core.cut_short(action.req, out)
                continue
            await self._retract(action.victim)
            if action.victim in decode:
                decode.remove(action.victim)
        return decode

    async def _log_cut_short(self, req: Req, why: str) -> None:
        """A request ended because the pool cannot hold it: logged with the pool's state
        (without it when the allocator does not answer within a second)."""
        pool: dict = {}
        with anyio.move_on_after(1.0):
            try:
                kv = await self.alloc.call(KvStatsRequest(reclaimable=True), expect=KvStats)
            except (RemoteError, ChannelClosed, TimeoutError):
                kv = None
            if kv is not None:
                pool = {
                    k: getattr(kv, k)
                    for k in (
                        "free_pages",
                        "evictable_pages",
                        "tree_pages",
                        "held_pages",
                        "session_pages",
                        "session_slots",
                        "reclaimable_pages",
                        "held_rows",
                        "swa_free_pages",
                    )
                }
        self.log.warning(
            "request cut short: the pool cannot hold it",
            rid=req.rid,
            why=why,
            tokens=req.num_tokens,
            computed=req.committed,
            outputs=len(req.output_ids),
            running=len(self.core.running),
            prefilling=len(self.core.prefilling),
            waiting=len(self.core.waiting),
            **pool,
        )

    async def _retract(self, victim: Req) -> None:
        await self._call(
            self.alloc,
            ReleaseBatch(items=[self.core.retract_item(victim)], commits=self.core.take_commits()),
        )
        self.core.on_retracted(victim)

    async def _schedule_prefill(self, num_decode: int, out: StepOutbox) -> list[PrefillWork]:
        core = self.core
        await self._send_releases(out)
        budget = core.prefill_budget(num_decode)
        if budget <= 0:
            return []
        chunks = core.continuing_chunks(budget)
        budget -= sum(c.budget for c in chunks)
        if core.wants_admission(budget):
            self.tried_admission = True
            cached_lens = None
            if core.policy is Policy.LPM and self.radix_ref is not None and len(core.waiting) > 1:
                peek = await self._call(
                    self.radix_ref,
                    # salted keys: a request only matches within its cache_salt namespace
                    PeekPrefix(
                        tokens=[
                            salted_tokens(r.tokens, r.params.cache_salt).tolist()
                            for r in core.waiting
                        ]
                    ),
                    expect=PeekReply,
                )
                cached_lens = peek.lengths
            kv = await self._call(self.alloc, KvStatsRequest(), expect=KvStats)
            self.disk_entries = kv.disk_tier_entries > 0
            chunks += core.admissions(budget, kv, cached_lens)
        if not chunks:
            return []
        reply = await self._call(
            self.alloc,
            AllocExtend(
                items=[
                    ExtendItem(
                        rid=c.req.rid,
                        tokens=c.req.tokens,
                        budget=c.budget,
                        match_prefix=c.req.params.prompt_logprobs is None,
                        session_id=c.req.session_id,
                        cache_salt=c.req.params.cache_salt,
                    )
                    for c in chunks
                ]
            ),
            expect=AllocExtendReply,
        )
        return core.apply_grants(chunks, reply.grants, reply.deltas)

    async def _send_releases(self, out: StepOutbox) -> None:
        """Pending releases reach the allocator before the step allocates anything more."""
        if out.releases:
            await self._call(
                self.alloc,
                ReleaseBatch(items=out.take_releases(), commits=self.core.take_commits()),
            )

    async def _flush(self, out: StepOutbox, hold_report: bool = False) -> None:
        """Releases now; the token report now, or (`hold_report`) with the next forward."""
        await self._send_releases(out)
        if out.has_news:
            assert self._report is None, "a token report was left unsent"
            self._report = out.token_batch()  # built now: it reads the requests as they are
            if not hold_report:
                await self._send_report()

    async def _send_report(self) -> None:
        """Send the held token report, if any; never lost to a cancellation midway."""
        if self._report is not None:
            report, self._report = self._report, None
            self.step_messages += 1
            with anyio.CancelScope(shield=True):
                await self.tokenizer.send(report)
