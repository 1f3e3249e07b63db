"""What one step sends besides its allocator calls: the forward batch and the token report.

Pure builders over the scheduler's requests; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from actors.scheduler.request import Req
from transport.messages.alloc import ReleaseItem, SlotDeltas
from transport.messages.engine import TokenBatch
from transport.messages.runner import ForwardBatchMsg, RunnerRequest, StepResultMsg


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """Positions [start, end) of `req` are computed in this step's forward."""

    req: Req
    start: int
    end: int

    @property
    def is_last_chunk(self) -> bool:
        return self.end == self.req.num_tokens


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token of a step, with its logprobs when the request asked."""

    token: int
    logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def sampled_tokens(result: StepResultMsg) -> dict[int, list[SampledToken]]:
    """rid -> its tokens of the step (one, or a speculative step's accepted run)."""
    counts = result.counts or [1] * len(result.rids)
    out: dict[int, list[SampledToken]] = {}
    i = 0
    for rid, n in zip(result.rids, counts):
        toks = []
        for j in range(i, i + n):
            if result.logprobs:
                toks.append(
                    SampledToken(
                        result.tokens[j],
                        result.logprobs[j],
                        tuple(result.top_ids[j]) if result.top_ids else (),
                        tuple(result.top_logprobs[j]) if result.top_logprobs else (),
                    )
                )
            else:
                toks.append(SampledToken(result.tokens[j]))
        out[rid] = toks
        i += n
    return out


@dataclass(frozen=True, slots=True)
class Report:
    """One line of the step's token report: new tokens of `req`, and its end if it ended."""

    req: Req
    tokens: tuple[SampledToken, ...]
    finish: str  # "" while running, else a FinishReason
    error: str = ""  # with finish "error": what the client is told ("": its runner failed)


@dataclass
class StepOutbox:
    """Releases and token reports collected while a step runs."""

    releases: list[ReleaseItem] = field(default_factory=list)  # not yet sent
    reports: list[Report] = field(default_factory=list)
    released: int = 0  # releases already sent this step
    # prompt logprobs of this step: (rid, first prompt position, logprobs, ranks, top ids,
    # top logprobs)
    prompt: list[tuple] = field(default_factory=list)

    def prompt_logprobs(self, result: StepResultMsg, work: dict[int, PrefillWork]) -> None:
        """Take the step's prompt logprobs; each covers prompt tokens start + 1 onward."""
        pos = 0
        for rid, n in zip(result.prompt_rids, result.prompt_counts):
            w = work[rid]
            first = w.start + 1
            self.prompt.append(
                (
                    rid,
                    first,
                    result.prompt_token_logprobs[pos : pos + n],
                    result.prompt_ranks[pos : pos + n],
                    result.prompt_top_ids[pos : pos + n],
                    result.prompt_top_logprobs[pos : pos + n],
                )
            )
            w.req.prompt_lp_next = first + n
            pos += n

    def take_releases(self) -> list[ReleaseItem]:
        items, self.releases = self.releases, []
        self.released += len(items)
        return items

    def report(
        self, req: Req, tokens: Sequence[SampledToken] = (), finish: str = "", error: str = ""
    ) -> None:
        self.reports.append(Report(req, tuple(tokens), finish, error))

    @property
    def any_finish(self) -> bool:
        return any(r.finish for r in self.reports)

    @property
    def has_news(self) -> bool:
        """Something for the tokenizer: token reports or prompt logprobs."""
        return bool(self.reports or self.prompt)

    def token_batch(self) -> TokenBatch:
        rids, counts, toks, finish, cached, queued = [], [], [], [], [], []
        logprobs, top_ids, top_lps = [], [], []
        any_lp = any(t.logprob is not None for r in self.reports for t in r.tokens)
        for rep in self.reports:
            req = rep.req
            rids.append(req.rid)
            counts.append(len(rep.tokens))
            toks.extend(t.token for t in rep.tokens)
            finish.append(str(rep.finish))
            if not req.cached_reported and req.cached_tokens >= 0:
                cached.append(req.cached_tokens)
                queued.append(req.queued_s)
                req.cached_reported = True
            else:
                cached.append(-1)
                queued.append(-1.0)
            if any_lp:
                for t in rep.tokens:
                    logprobs.append(0.0 if t.logprob is None else t.logprob)
                    top_ids.append(list(t.top_ids))
                    top_lps.append(list(t.top_logprobs))
        return TokenBatch(
            rids=rids,
            counts=counts,
            tokens=toks,
            finish=finish,
            cached=cached,
            logprobs=logprobs,
            top_ids=top_ids,
            top_logprobs=top_lps,
            queued_s=queued,
            prompt_rids=[p[0] for p in self.prompt],
            prompt_starts=[p[1] for p in self.prompt],
            prompt_counts=[len(p[2]) for p in self.prompt],
            prompt_token_logprobs=[x for p in self.prompt for x in p[2]],
            prompt_ranks=[x for p in self.prompt for x in p[3]],
            prompt_top_ids=[x for p in self.prompt for x in p[4]],
            prompt_top_logprobs=[x for p in self.prompt for x in p[5]],
            error_rids=[r.req.rid for r in self.reports if r.error],
            error_texts=[r.error for r in self.reports if r.error],
        )


def merge_deltas(parts: Sequence[SlotDeltas]) -> SlotDeltas:
    """One `SlotDeltas` with the effect of applying `parts` in order.

    The runner applies a batch's deltas as one indexed write (rows, and the sliding page
    map), where a position written twice has no defined winner. Parts from several
    allocator replies can touch one position twice (a page unmapped by a release, then
    mapped again; a failed step's deltas replayed before a row is reused), so the merge
    keeps each position's last value."""
    parts = [p for p in parts if p.rows or p.swa_full_pages]
    if not parts:
        return SlotDeltas()
    if len(parts) == 1:
        return parts[0]
    rows, starts, lengths, slots = _last_row_writes(
        np.asarray([x for p in parts for x in p.rows], dtype=np.int64),
        np.asarray([x for p in parts for x in p.starts], dtype=np.int64),
        np.asarray([x for p in parts for x in p.lengths], dtype=np.int64),
        np.asarray([x for p in parts for x in p.slots], dtype=np.int64),
    )
    full, swa = _last_values(
        np.asarray([x for p in parts for x in p.swa_full_pages], dtype=np.int64),
        np.asarray([x for p in parts for x in p.swa_pages], dtype=np.int64),
    )
    return SlotDeltas(
        rows=rows.tolist(),
        starts=starts.tolist(),
        lengths=lengths.tolist(),
        slots=slots.tolist(),
        swa_full_pages=full.tolist(),
        swa_pages=swa.tolist(),
    )


def _last_values(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each key once, with its last value (keys sorted)."""
    if keys.size == 0:
        return keys, values
    _, from_end = np.unique(keys[::-1], return_index=True)
    keep = keys.size - 1 - from_end
    return keys[keep], values[keep]


def _last_row_writes(rows, starts, lengths, slots):
    """Row runs (row, start, length, their slots) rewritten so each (row, position) is
    written once, with its last slot, as runs of consecutive positions."""
    if rows.size == 0:
        return rows, starts, lengths, slots
    row_of = np.repeat(rows, lengths)
    run_first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pos = np.arange(slots.size, dtype=np.int64) - run_first + np.repeat(starts, lengths)
    key = row_of * (int(pos.max()) + 1) + pos
    key, keep = _last_values(key, np.arange(slots.size))
    r, p, s = row_of[keep], pos[keep], slots[keep]
    first = np.flatnonzero(np.concatenate([[True], (np.diff(r) != 0) | (np.diff(p) != 1)]))
    run_lengths = np.diff(np.concatenate([first, [r.size]]))
    return r[first], p[first], run_lengths, s


def runner_request(req: Req) -> RunnerRequest:
    """What the runner keeps for `req` between steps (its sampler state is built from it)."""
    p = req.params
    return RunnerRequest(
        rid=req.rid,
        params=p,
        prompt_ids=req.prompt_ids if p.repetition_penalty != 1.0 else [],
        grammar_key=req.grammar_key,
    )


def forward_batch(
    step: int,
    decode: Sequence[Req],
    prefill: Sequence[PrefillWork],
    deltas: Sequence[SlotDeltas],
    finished_rids: Sequence[int],
) -> tuple[ForwardBatchMsg, list[Req]]:
    """The step's forward batch, and the requests it registers with the runner."""
    rids, rows, prefix, ext, ids, need, drafts = [], [], [], [], [], [], []
    for req in decode:
        rids.append(req.rid)
        rows.append(req.row)
        # With drafts the step's position is not committed yet (it is with the verdict).
        prefix.append(req.committed if req.draft else req.committed - 1)
        ext.append(1 + len(req.draft))
        ids.append(req.output_ids[-1] if req.output_ids else req.prompt_ids[-1])
        ids.extend(req.draft)
        need.append(True)
        drafts.append(len(req.draft))
    prompt_lps, next_ids = [-1] * len(decode), [-1] * len(decode)
    for work in prefill:
        req = work.req
        rids.append(req.rid)
        rows.append(req.row)
        prefix.append(work.start)
        ext.append(work.end - work.start)
        ids.extend(req.tokens[work.start : work.end])
        need.append(work.is_last_chunk)
        if req.wants_prompt_logprobs:
            prompt_lps.append(req.params.prompt_logprobs or 0)
            next_ids.append(req.prompt_ids[work.end] if work.end < len(req.prompt_ids) else -1)
        else:
            prompt_lps.append(-1)
            next_ids.append(-1)
    if all(k < 0 for k in prompt_lps):
        prompt_lps, next_ids = [], []
    drafts += [0] * len(prefill)
    if not any(drafts):
        drafts = []
    new: list[Req] = []
    for req in [*decode, *(w.req for w in prefill)]:
        if not req.registered and req not in new:
            new.append(req)
    batch = ForwardBatchMsg(
        step=step,
        rids=rids,
        rows=rows,
        prefix_lens=prefix,
        extend_lens=ext,
        input_ids=ids,
        need_logits=need,
        deltas=merge_deltas(deltas),
        new_reqs=[runner_request(r) for r in new],
        finished_rids=list(finished_rids),
        prompt_logprobs=prompt_lps,
        next_ids=next_ids,
        draft_lens=drafts,
    )
    return batch, new
