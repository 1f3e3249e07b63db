"""Scheduling policy: pure decisions over plain data, no messages, no awaits.

Every function here takes the scheduler's requests and snapshots (a `KvStats` from the
allocator, prefix lengths from the radix cache) and returns a decision; `SchedulerCore`
applies them and the actor turns them into messages. The rules, as SGLang's:

* Decode first: every running request gets one slot per step, plus its draft tokens' when
  it speculates (the allocator grants all or none). On a shortfall the drafts go first,
  then a victim is retracted (`pick_victim`): the one whose loss costs
  least (fewest output tokens, then the longest prompt), its computed prefix kept in the
  prefix tree for re-admission. A request alone that still cannot grow is cut at `length`.
* Prefill under a token budget (`max_batch_tokens` minus the step's decode tokens):
  continuing chunks first, then admissions in FCFS or longest-prefix-match order, each
  chunk at most `chunk_size`.
* Admission reserves KV: a request needs its prompt's pages plus `future_pages` (a share of
  its remaining `max_tokens` given by the decaying `NewTokenRatio`, plus one page). It is
  admitted while free + evictable pages cover every active request's reservation plus its
  own; the first request is always tried when nothing else runs. With a sliding-window pool
  the same holds there, where a request needs at most its window plus a chunk of output,
  and its whole prompt besides when prompts keep their sliding KV (the default).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from actors.scheduler.request import Req
from transport.messages.alloc import KvStats
from transport.messages.engine import FinishReason

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's decode estimate (as SGLang)
RETRACT_TOKEN_RESERVE = 20  # per request, added to the ratio estimate after a retraction


class Policy(enum.StrEnum):
    FCFS = "fcfs"  # first come, first served
    LPM = "lpm"  # longest cached prefix first


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    page_size: int
    row_capacity: int  # tokens a request may hold (prompt + output)
    max_running: int
    max_batch_tokens: int
    chunk_size: int
    sliding_window: int = 0  # with a sliding-layer pool of its own: the window; else 0


class NewTokenRatio:
    """The share of a request's remaining `max_tokens` that admission reserves KV for.

    Starts at `initial`, decays linearly to `floor` over `decay_steps` decode steps (requests
    usually stop before max_tokens), is raised after a retraction to what the running set
    actually needed, and returns to `initial` when the engine goes idle.
    """

    def __init__(self, initial: float, floor: float, decay_steps: int = 600) -> None:
        self.initial = initial
        self.floor = floor
        self.step = (initial - floor) / max(decay_steps, 1)
        self.value = initial

    def decay(self) -> None:
        self.value = max(self.floor, self.value - self.step)

    def reset(self) -> None:
        self.value = self.initial

    def after_retraction(self, running: Sequence[Req]) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(r.params.max_tokens for r in running)
        self.value = min(1.0, (decoded + RETRACT_TOKEN_RESERVE * len(running)) / (max_new + 1))


def future_pages(req: Req, ratio: float, page_size: int) -> int:
    """Pages `req` may still need: the rest of its prefill plus its expected decode."""
    new = min(req.remaining_new, CLIP_MAX_NEW_TOKENS) * ratio
    rest_prefill = req.prefill_left if req.admitted else 0
    return math.ceil((new + rest_prefill) / page_size) + 1


def swa_future_pages(req: Req, ratio: float, page_size: int, cap: int, keeps_prompt: bool) -> int:
    """Sliding pages `req` may still need: the window caps what its output holds at once;
    a prompt that keeps its sliding KV holds all of its pages until the request ends."""
    if not keeps_prompt:
        return min(future_pages(req, ratio, page_size), cap)
    new = min(req.remaining_new, CLIP_MAX_NEW_TOKENS) * ratio
    rest_prefill = req.prefill_left if req.admitted else 0
    decode = min(math.ceil(new / page_size) + 1, cap)
    return math.ceil(rest_prefill / page_size) + decode


def pick_victim(candidates: Sequence[Req]) -> Req:
    """The request to retract: least work lost (fewest outputs, then the longest prompt)."""
    return min(candidates, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))


def admission_order(waiting: Sequence[Req], cached_lens: Sequence[int] | None) -> list[Req]:
    """FCFS order, or (given each request's cached prefix length) longest match first; ties
    keep arrival order."""
    if cached_lens is None:
        return list(waiting)
    # Requests that arrived after the lengths were asked for (the queue only grows at its
    # end meanwhile) have none: 0.
    lens = [cached_lens[i] if i < len(cached_lens) else 0 for i in range(len(waiting))]
    order = sorted(range(len(waiting)), key=lambda i: -lens[i])
    return [waiting[i] for i in order]


def admit(
    candidates: Sequence[Req],
    active: Sequence[Req],
    kv: KvStats,
    budget: int,
    limits: SchedulerLimits,
    ratio: float,
) -> list[Req]:
    """The prefix of `candidates` to admit this step.

    Stops at the first request that does not fit (no skipping ahead: a large request is not
    starved by small ones), when the token budget or the running slots are used up.
    """
    slots = limits.max_running - len(active)
    ps = limits.page_size
    available = kv.free_pages + kv.evictable_pages
    reserved = sum(future_pages(r, ratio, ps) for r in active)
    split = bool(limits.sliding_window and kv.swa_total_pages)
    # A request holds at most its window, a chunk and a page of sliding KV at once.
    swa_cap = math.ceil((limits.sliding_window + limits.chunk_size) / ps) + 2
    keeps = kv.swa_keeps_prompt
    swa_available = kv.swa_free_pages + kv.evictable_pages
    swa_reserved = sum(swa_future_pages(r, ratio, ps, swa_cap, keeps) for r in active)
    picked: list[Req] = []
    for req in candidates[: max(slots, 0)]:
        if budget <= 0:
            break
        need = math.ceil(req.num_tokens / ps) + future_pages(req, ratio, ps)
        swa_need = min(need, swa_cap)
        if keeps:
            swa_need = math.ceil(req.num_tokens / ps) + swa_future_pages(
                req, ratio, ps, swa_cap, keeps
            )
        if (active or picked) and (
            reserved + need > available or (split and swa_reserved + swa_need > swa_available)
        ):
            break
        reserved += need
        swa_reserved += swa_need
        picked.append(req)
        budget -= min(limits.chunk_size, budget, req.num_tokens)
    return picked


@dataclass(frozen=True, slots=True)
class Chunk:
    """Ask the allocator for at most `budget` more prefill tokens of `req`."""

    req: Req
    budget: int


def continuing_chunks(prefilling: Sequence[Req], budget: int, chunk_size: int) -> list[Chunk]:
    chunks = []
    for req in prefilling:
        if budget <= 0:
            break
        take = min(chunk_size, budget, req.prefill_left)
        chunks.append(Chunk(req, take))
        budget -= take
    return chunks


def first_chunks(admitted: Sequence[Req], budget: int, chunk_size: int) -> list[Chunk]:
    chunks = []
    for req in admitted:
        take = min(chunk_size, budget, req.num_tokens)
        chunks.append(Chunk(req, take))
        budget -= take
        if budget <= 0:
            break
    return chunks


@dataclass(frozen=True, slots=True)
class Retract:
    victim: Req


@dataclass(frozen=True, slots=True)
class CutShort:
    """The pool cannot hold `req` even alone: end it at `length`."""

    req: Req


def on_decode_shortfall(decode: Sequence[Req], prefilling: Sequence[Req]) -> Retract | CutShort:
    if len(decode) == 1 and not prefilling:
        return CutShort(decode[0])
    return Retract(pick_victim([*decode, *prefilling]))


def unstick(
    running: Sequence[Req], prefilling: Sequence[Req], waiting: Sequence[Req]
) -> Retract | CutShort | None:
    """Nothing could run this step: what frees the engine, if anything."""
    if running:
        return None
    if len(prefilling) > 1:
        return Retract(pick_victim(prefilling))
    if prefilling:
        return CutShort(prefilling[-1])
    if waiting:
        return CutShort(waiting[0])
    return None


def finish_reason(req: Req, token: int, row_capacity: int) -> FinishReason | None:
    """Why `req` ends after emitting `token` (already appended), or None."""
    n = len(req.output_ids)
    if n >= req.params.min_tokens and (token in req.eos_ids or token in req.stop_ids):
        return FinishReason.STOP
    if n >= req.params.max_tokens or req.num_tokens >= row_capacity:
        return FinishReason.LENGTH
    return None
