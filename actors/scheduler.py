"""The scheduler actor: waiting queue, running set, and the step loop.

Each step (continuous batching under a token budget):
  1. apply pending ends (aborts, stop strings) at this safe point;
  2. decode: every running request gets one slot (`AllocDecode`, all or nothing);
     on a shortfall, retract a victim (its computed prefix goes to the tree) and retry;
  3. prefill: continuing chunks first, then admissions (FCFS or longest prefix match),
     under the remaining token budget, `chunk_size`, `max_running_requests` and a KV
     estimate (prompt + a decaying share of max_tokens);
  4. one `ForwardBatchMsg` to the runner, carrying every slot delta the allocator returned;
  5. one `TokenBatch` to the tokenizer; finished requests released in one `ReleaseBatch`,
     non-final chunks cached in one `CacheUnfinished`.
A decode step with no admission and no finish costs three messages whatever the batch size:
AllocDecode (call), ForwardBatchMsg (call), TokenBatch (send).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import anyio

from actors.runtime import Actor
from transport.messages.alloc import (
    RELEASE_ABORT,
    RELEASE_FINISH,
    RELEASE_RETRACT,
    AllocDecode,
    AllocDecodeReply,
    AllocExtend,
    AllocExtendReply,
    CacheUnfinished,
    CacheUnfinishedReply,
    ExtendItem,
    KvStats,
    KvStatsRequest,
    ReleaseBatch,
    ReleaseItem,
    SlotDeltas,
)
from transport.messages.engine import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EndRequests,
    GenerationParams,
    SchedulerStats,
    SchedulerStatsRequest,
    SubmitRequests,
    TokenBatch,
)
from transport.messages.radix import PeekPrefix, PeekReply
from transport.messages.runner import ForwardBatchMsg, SamplingSpec, StepResultMsg

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's decode estimate (as SGLang)
RETRACT_TOKEN_RESERVE = 20  # per request, added to the ratio estimate after a retraction


@dataclass(eq=False)
class Req:
    rid: int
    prompt_ids: list[int]
    params: GenerationParams
    eos_ids: frozenset[int]
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    committed: int = 0  # tokens whose KV is computed (mirrors the allocator's record)
    admitted: bool = False  # holds KV
    registered: bool = False  # the runner holds its sampler state
    cached_tokens: int = -1  # set at the first prefill grant
    cached_reported: bool = False
    row: int = -1
    retractions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new(self) -> int:
        return max(self.params.max_tokens - len(self.output_ids), 0)


class SchedulerActor(Actor):
    inbox = SubmitRequests | EndRequests | SchedulerStatsRequest

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
    ) -> None:
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be 'fcfs' or 'lpm', got {policy!r}")
        self.page_size = page_size
        self.row_capacity = row_capacity
        self.max_running = max_running_requests
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.policy = policy
        self.radix = radix
        self.init_ratio = new_token_ratio
        self.min_ratio = min_new_token_ratio
        self.ratio = new_token_ratio
        self.ratio_step = (new_token_ratio - min_new_token_ratio) / max(ratio_decay_steps, 1)
        self.runner_timeout_s = runner_timeout_s
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully in KV
        self.running: list[Req] = []  # decoding
        self.reqs: dict[int, Req] = {}
        self.pending_ends: dict[int, str] = {}
        self.unregister: list[int] = []  # sampler states the runner may drop
        self.carry_deltas: list[SlotDeltas] = []  # row rewrites to ship with the next batch
        self.pending_retract: Req | None = None
        self.wake = anyio.Event()
        self.step_no = 0
        self.counters = dict(
            decode_steps=0,
            retractions=0,
            prompt_tokens=0,
            generated_tokens=0,
            cached_tokens=0,
            pure_decode_steps=0,
            pure_decode_messages=0,
        )
        self.step_messages = 0  # messages this scheduler sent during the current step
        self.tried_admission = False  # this step asked for KV stats to admit from the queue

    # ---- mailbox -------------------------------------------------------------------------
    async def on_start(self) -> None:
        self.alloc = self.ref("allocator")
        self.runner = self.ref("runner")
        self.tokenizer = self.ref("tokenizer")
        self.radix_ref = self.ref("radix") if self.radix else None
        self.spawn(self._loop)

    async def handle(self, msg, sender):
        if isinstance(msg, SubmitRequests):
            for new in msg.reqs:
                p = new.params
                req = Req(
                    rid=new.rid,
                    prompt_ids=list(new.prompt_ids),
                    params=p,
                    eos_ids=frozenset(() if p.ignore_eos else new.eos_ids),
                    stop_ids=frozenset(p.stop_token_ids),
                )
                self.reqs[req.rid] = req
                self.waiting.append(req)
        elif isinstance(msg, EndRequests):
            for rid in msg.rids:
                if rid in self.reqs:
                    self.pending_ends.setdefault(rid, msg.reason)
        elif isinstance(msg, SchedulerStatsRequest):
            return SchedulerStats(
                waiting=len(self.waiting),
                running=len(self.running),
                prefilling=len(self.prefilling),
                steps=self.step_no,
                new_token_ratio=self.ratio,
                **self.counters,
            )
        self.wake.set()
        return None

    def stats(self) -> dict[str, int | float]:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running) + len(self.prefilling),
            "steps": self.step_no,
            **self.counters,
        }

    async def _call(self, ref, msg, **kw):
        self.step_messages += 1
        return await ref.call(msg, **kw)

    # ---- the step loop -------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not (self.waiting or self.prefilling or self.running or self.pending_ends):
                self.wake = anyio.Event()
                self.ratio = self.init_ratio
                await self.wake.wait()
            progressed = await self.step()
            if not progressed:
                # Nothing could run (e.g. waiting for KV held by nobody we can retract).
                self.wake = anyio.Event()
                with anyio.move_on_after(0.05):
                    await self.wake.wait()

    async def step(self) -> bool:
        out = _Outbox()
        self.step_messages = 0
        self.tried_admission = False
        retractions = self.counters["retractions"]
        if self.pending_retract is not None:
            victim, self.pending_retract = self.pending_retract, None
            if victim.admitted:
                await self._retract(victim)
        await self._apply_ends(out)
        deltas, self.carry_deltas = self.carry_deltas, []
        decode = await self._schedule_decode(deltas, out)
        prefill = await self._schedule_prefill(len(decode), deltas, out)
        if not decode and not prefill:
            self.carry_deltas = deltas + self.carry_deltas
            self._unstick(out)
            await self._flush(out)
            return bool(out.entries)
        self.step_no += 1
        batch, new_specs = self._build_batch(decode, prefill, deltas)
        result: StepResultMsg = await self._call(
            self.runner, batch, expect=StepResultMsg, timeout=self.runner_timeout_s
        )
        for req in new_specs:
            req.registered = True
        await self._process(decode, prefill, result, out)
        await self._flush(out)
        pure = (
            not prefill
            and not out.releases
            and not self.tried_admission
            and retractions == self.counters["retractions"]
        )
        if pure and not any(e[2] for e in out.entries):
            # A decode step with no admission, no finish, no end: its cost is constant.
            self.counters["pure_decode_steps"] += 1
            self.counters["pure_decode_messages"] += self.step_messages
        return True

    def _unstick(self, out: _Outbox) -> None:
        """Nothing ran and nothing decodes: the pool cannot hold what is admitted or next."""
        if self.running:
            return
        if len(self.prefilling) > 1:
            self.pending_retract = self._pick_victim(self.prefilling)
        elif self.prefilling:
            self._finish(self.prefilling.pop(), FINISH_LENGTH, out)
        elif self.waiting:
            self._finish(self.waiting.popleft(), FINISH_LENGTH, out)

    # ---- ends (abort / stop string) ------------------------------------------------------
    async def _apply_ends(self, out: _Outbox) -> None:
        if not self.pending_ends:
            return
        ends, self.pending_ends = self.pending_ends, {}
        for rid, reason in ends.items():
            req = self.reqs.get(rid)
            if req is None:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            elif req in self.prefilling:
                self.prefilling.remove(req)
            elif req in self.running:
                self.running.remove(req)
            self._finish(req, reason, out)

    def _finish(self, req: Req, reason: str, out: _Outbox, tokens=(), lp=None) -> None:
        """Record the end of a request; its KV goes back in this step's ReleaseBatch."""
        del self.reqs[req.rid]
        if req.admitted:
            cache = reason != FINISH_ABORT
            kind = RELEASE_FINISH if cache else RELEASE_ABORT
            out.releases.append(
                ReleaseItem(rid=req.rid, kind=kind, tokens=req.tokens if cache else [])
            )
            req.admitted = False
        elif req.retractions:
            # A retracted request keeps an empty record at the allocator: drop it.
            out.releases.append(ReleaseItem(rid=req.rid, kind=RELEASE_ABORT))
        if req.registered:
            self.unregister.append(req.rid)
        out.report(req, list(tokens), reason, lp)

    # ---- decode --------------------------------------------------------------------------
    async def _schedule_decode(self, deltas: list[SlotDeltas], out: _Outbox) -> list[Req]:
        decode = list(self.running)
        while decode:
            reply = await self._call(
                self.alloc, AllocDecode(rids=[r.rid for r in decode]), expect=AllocDecodeReply
            )
            if reply.short_pages == 0:
                deltas.append(reply.deltas)
                for req in decode:
                    req.committed += 1
                self.counters["decode_steps"] += 1
                self.ratio = max(self.min_ratio, self.ratio - self.ratio_step)
                return decode
            if len(decode) == 1 and not self.prefilling:
                # Even alone it cannot grow: the pool is too small for this context.
                req = decode.pop()
                self.running.remove(req)
                self._finish(req, FINISH_LENGTH, out)
                continue
            victim = self._pick_victim(decode + self.prefilling)
            await self._retract(victim)
            if victim in decode:
                decode.remove(victim)
        return decode

    def _pick_victim(self, cands: list[Req]) -> Req:
        # Keep requests with more output and shorter prompts (least work lost), as SGLang.
        return min(cands, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))

    async def _retract(self, req: Req) -> None:
        await self._call(
            self.alloc,
            ReleaseBatch(items=[ReleaseItem(rid=req.rid, kind=RELEASE_RETRACT, tokens=req.tokens)]),
        )
        if req in self.running:
            self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        req.admitted = False
        req.committed = 0
        req.retractions += 1
        self.waiting.appendleft(req)
        self.counters["retractions"] += 1
        decoded = sum(len(r.output_ids) for r in self.running)
        max_new = sum(r.params.max_tokens for r in self.running)
        n = len(self.running)
        self.ratio = min(1.0, (decoded + RETRACT_TOKEN_RESERVE * n) / (max_new + 1))

    # ---- prefill -------------------------------------------------------------------------
    async def _schedule_prefill(self, num_decode: int, deltas: list[SlotDeltas], out: _Outbox):
        budget = self.max_batch_tokens - num_decode
        if budget <= 0 or not (self.prefilling or self.waiting):
            return []
        items: list[tuple[Req, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(self.chunk_size, budget, req.num_tokens - req.committed)
            items.append((req, take))
            budget -= take
        admitted: list[Req] = []
        if self.waiting and budget > 0:
            admitted = await self._pick_admissions(budget)
            for req in admitted:
                take = min(self.chunk_size, budget, req.num_tokens)
                items.append((req, take))
                budget -= take
                if budget <= 0:
                    break
        if not items:
            return []
        reply = await self._call(
            self.alloc,
            AllocExtend(items=[ExtendItem(rid=r.rid, tokens=r.tokens, budget=b) for r, b in items]),
            expect=AllocExtendReply,
        )
        deltas.append(reply.deltas)
        granted = []
        for (req, _), g in zip(items, reply.grants):
            if g.row < 0:
                continue  # refused: no KV now; stays where it was
            if not req.admitted:
                req.admitted = True
                self.waiting.remove(req)
                self.prefilling.append(req)
                if req.cached_tokens < 0:
                    req.cached_tokens = g.cached_len
                    self.counters["cached_tokens"] += g.cached_len
            req.committed = g.end
            req.row = g.row
            self.counters["prompt_tokens"] += g.end - g.start
            granted.append((req, g.start, g.end))
        return granted

    async def _pick_admissions(self, budget: int) -> list[Req]:
        slots = self.max_running - len(self.running) - len(self.prefilling)
        if slots <= 0:
            return []
        self.tried_admission = True
        cands = list(self.waiting)
        if self.policy == "lpm" and self.radix_ref is not None and len(cands) > 1:
            peek = await self._call(
                self.radix_ref, PeekPrefix(tokens=[r.tokens for r in cands]), expect=PeekReply
            )
            order = sorted(range(len(cands)), key=lambda i: -peek.lengths[i])
            cands = [cands[i] for i in order]
        stats = await self._call(self.alloc, KvStatsRequest(), expect=KvStats)
        ps = self.page_size
        available = stats.free_pages + stats.evictable_pages
        reserved = sum(self._future_pages(r) for r in self.running + self.prefilling)
        picked: list[Req] = []
        for req in cands[:slots]:
            if budget <= 0:
                break
            need = math.ceil(req.num_tokens / ps) + self._future_pages(req)
            busy = self.running or self.prefilling or picked
            if busy and reserved + need > available:
                break
            reserved += need
            picked.append(req)
            budget -= min(self.chunk_size, budget, req.num_tokens)
        return picked

    def _future_pages(self, req: Req) -> int:
        new = min(req.remaining_new, CLIP_MAX_NEW_TOKENS) * self.ratio
        rest_prefill = req.num_tokens - req.committed if req.admitted else 0
        return math.ceil((new + rest_prefill) / self.page_size) + 1

    # ---- the forward batch -----------------------------------------------------------------
    def _build_batch(self, decode, prefill, deltas):
        rids, rows, prefix, ext, ids, need = [], [], [], [], [], []
        new_specs = []
        specs = []
        for req in decode:
            rids.append(req.rid)
            rows.append(req.row)
            prefix.append(req.committed - 1)
            ext.append(1)
            ids.append(req.output_ids[-1] if req.output_ids else req.prompt_ids[-1])
            need.append(True)
        for req, start, end in prefill:
            toks = req.tokens
            rids.append(req.rid)
            rows.append(req.row)
            prefix.append(start)
            ext.append(end - start)
            ids.extend(toks[start:end])
            need.append(end == len(toks))
        for req in [r for r in decode] + [p[0] for p in prefill]:
            if not req.registered and req not in new_specs:
                new_specs.append(req)
                specs.append(_sampling_spec(req))
        merged = _merge_deltas(deltas)
        unregister, self.unregister = self.unregister, []
        batch = ForwardBatchMsg(
            step=self.step_no,
            rids=rids,
            rows=rows,
            prefix_lens=prefix,
            extend_lens=ext,
            input_ids=ids,
            need_logits=need,
            deltas=merged,
            new_reqs=specs,
            finished_rids=unregister,
        )
        return batch, new_specs

    # ---- results ---------------------------------------------------------------------------
    async def _process(self, decode, prefill, result: StepResultMsg, out: _Outbox) -> None:
        sampled = dict(zip(result.rids, range(len(result.rids))))
        unfinished: list[Req] = []
        for req, start, end in prefill:
            if end < req.num_tokens:
                unfinished.append(req)
            elif req in self.prefilling:
                self.prefilling.remove(req)
                self.running.append(req)
        for req in list(decode) + [p[0] for p in prefill]:
            i = sampled.get(req.rid)
            if i is None:
                continue
            tok = result.tokens[i]
            req.output_ids.append(tok)
            self.counters["generated_tokens"] += 1
            lp = (
                (
                    result.logprobs[i],
                    result.top_ids[i] if result.top_ids else [],
                    result.top_logprobs[i] if result.top_logprobs else [],
                )
                if result.logprobs
                else None
            )
            reason = self._finish_reason(req, tok)
            if reason is None:
                out.report(req, [tok], "", lp)
            else:
                self.running.remove(req)
                self._finish(req, reason, out, [tok], lp)
        if unfinished:
            reply = await self._call(
                self.alloc,
                CacheUnfinished(
                    rids=[r.rid for r in unfinished], tokens=[r.tokens for r in unfinished]
                ),
                expect=CacheUnfinishedReply,
            )
            self.carry_deltas.append(reply.deltas)

    def _finish_reason(self, req: Req, tok: int) -> str | None:
        n = len(req.output_ids)
        if n >= req.params.min_tokens and (tok in req.eos_ids or tok in req.stop_ids):
            return FINISH_STOP
        if n >= req.params.max_tokens or req.num_tokens >= self.row_capacity:
            return FINISH_LENGTH
        return None

    async def _flush(self, out: _Outbox) -> None:
        if out.releases:
            await self._call(self.alloc, ReleaseBatch(items=out.releases))
        if out.entries:
            self.step_messages += 1
            await self.tokenizer.send(out.token_batch())


class _Outbox:
    """What one step sends besides the forward: releases and the token report."""

    def __init__(self) -> None:
        self.releases: list[ReleaseItem] = []
        self.entries: list[tuple[Req, list[int], str, tuple | None]] = []

    def report(self, req: Req, tokens: list[int], finish: str, lp: tuple | None = None) -> None:
        self.entries.append((req, tokens, finish, lp))

    def token_batch(self) -> TokenBatch:
        rids, counts, toks, finish, cached = [], [], [], [], []
        logprobs, top_ids, top_lps = [], [], []
        any_lp = any(e[3] is not None for e in self.entries)
        for req, tokens, reason, lp in self.entries:
            rids.append(req.rid)
            counts.append(len(tokens))
            toks.extend(tokens)
            finish.append(reason)
            if not req.cached_reported and req.cached_tokens >= 0:
                cached.append(req.cached_tokens)
                req.cached_reported = True
            else:
                cached.append(-1)
            if any_lp:
                for _ in tokens:
                    logprobs.append(lp[0] if lp else 0.0)
                    top_ids.append(list(lp[1]) if lp else [])
                    top_lps.append(list(lp[2]) if lp else [])
        return TokenBatch(
            rids=rids,
            counts=counts,
            tokens=toks,
            finish=finish,
            cached=cached,
            logprobs=logprobs,
            top_ids=top_ids,
            top_logprobs=top_lps,
        )


def _merge_deltas(parts: list[SlotDeltas]) -> SlotDeltas:
    parts = [p for p in parts if p.rows]
    if not parts:
        return SlotDeltas()
    if len(parts) == 1:
        return parts[0]
    return SlotDeltas(
        rows=[x for p in parts for x in p.rows],
        starts=[x for p in parts for x in p.starts],
        lengths=[x for p in parts for x in p.lengths],
        slots=[x for p in parts for x in p.slots],
    )


def _sampling_spec(req: Req) -> SamplingSpec:
    p = req.params
    return SamplingSpec(
        rid=req.rid,
        prompt_ids=req.prompt_ids if p.repetition_penalty != 1.0 else [],
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=-1 if p.seed is None else p.seed,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logprobs=p.logprobs,
        top_logprobs=p.top_logprobs,
    )
