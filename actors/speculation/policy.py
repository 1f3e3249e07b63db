"""When to speculate, and how far: the scheduler's per-step drafting plan.

Pure Python (no torch, no actors). Two rules (measurements: docs/benchmarks.md):

- Across the batch: verifying drafts costs compute, and at large batches a CPU step is
  compute-bound already, so speculation runs only while the step's decode requests number at
  most `max_batch`.
- Per request: drafts that keep being rejected cost a wider forward for nothing, so a request
  whose drafts were all rejected `MISS_LIMIT` steps in a row stops drafting for a pause that
  doubles with each further miss (up to `MAX_PAUSE` steps) and is reset by any acceptance.
- How far: a request drafts `num_speculative_tokens` at first (3 by default: with the
  token it verifies, 4 rows, the most the CPU linears' blocks kernel takes); a step that
  accepts all of them doubles its width (up to `max_speculative_tokens`: long copies verify
  many tokens a step, for little more than one token's forward), and any rejection brings
  it back.

A sampled request with a seed never drafts (`Speculator.may_draft`): its tokens must not
depend on the load. A request's drafts never reach past what it may still emit: k <= its
remaining tokens - 1 (the step emits at most k + 1), and the row's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MISS_LIMIT = 2
MAX_PAUSE = 64
LEARN_MAX_TOKENS = 4096
GREEDY_BELOW = 1e-5  # kernels.device_sampling.GREEDY_TEMPERATURE_BELOW: greedy sampling


@dataclass(slots=True)
class DraftBackoff:
    """One request's drafting record: consecutive all-rejected steps, and the pause left."""

    misses: int = 0
    pause: int = 0  # steps left without drafting
    next_pause: int = 1
    width: int = 0  # draft tokens it may propose next (0: the config's start)

    def ready(self) -> bool:
        """Whether the request drafts this step (a paused one counts the step down)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def observe(self, proposed: int, accepted: int) -> None:
        """After a step that verified `proposed` drafts, `accepted` of them kept."""
        if proposed <= 0:
            return
        if accepted > 0:
            self.misses, self.next_pause = 0, 1
            return
        self.misses += 1
        if self.misses >= MISS_LIMIT:
            self.pause = self.next_pause
            self.next_pause = min(2 * self.next_pause, MAX_PAUSE)
            self.misses = 0


@dataclass
class SpeculationStats:
    """Counters in vLLM's terms (`vllm:spec_decode_*`): steps that verified drafts, draft
    tokens proposed, draft tokens accepted, and accepted counts by draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def draft_budget(k: int, remaining_new: int, committed: int, row_capacity: int) -> int:
    """The most draft tokens a request may verify this step: at most `k`, at most what it may
    still emit minus the step's own token, and within its row (1 + k slots from
    `committed`)."""
    return max(0, min(k, remaining_new - 1, row_capacity - committed - 1))


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """The `[speculative]` config section, as the scheduler takes it."""

    method: str = "none"
    num_speculative_tokens: int = 3
    max_speculative_tokens: int = 16
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch: int = 4
    suffix_max_entries: int = 200_000


class Speculator:
    """The scheduler's drafting: who drafts this step and what (`plan`), what the verified
    steps gave (`observe`), and the drafter's per-request state (`finished`).

    Requests are the scheduler's (duck-typed: `rid`, `tokens`, `prompt_ids`, `committed`,
    `remaining_new`, `params.speculate`, and the `draft` / `backoff` it sets)."""

    def __init__(self, config: SpeculationConfig) -> None:
        from actors.speculation.drafters import PromptLookupDrafter, make_drafter

        self.config = config
        self.drafter = make_drafter(
            config.method,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.suffix_max_entries,
        )
        # A request with a cache_salt never drafts from, nor teaches, what other requests
        # wrote (a shared drafter would leak it across the salt's boundary): its own tokens
        # only.
        self.private = (
            PromptLookupDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "suffix"
            else self.drafter
        )
        self.stats = SpeculationStats()
        if self.drafter is not None:  # every position exported from the start, as vLLM
            self.stats.accepted_per_position = [0] * config.max_speculative_tokens

    @property
    def enabled(self) -> bool:
        return self.drafter is not None

    def plan(self, reqs: list, row_capacity: int, token_budget: int) -> bool:
        """Set each request's `draft` for this decode step (at most `token_budget` tokens
        in all, one per request included); whether anyone drafts."""
        for req in reqs:
            req.draft = []
        if self.drafter is None or len(reqs) > self.config.max_batch:
            return False
        spare = token_budget - len(reqs)
        drafting = False
        for req in reqs:
            if spare <= 0:
                break
            if not self.may_draft(req.params) or not req.backoff.ready():
                continue
            k = min(
                spare,
                draft_budget(
                    req.backoff.width or self.config.num_speculative_tokens,
                    req.remaining_new,
                    req.committed,
                    row_capacity,
                ),
            )
            if k <= 0:
                continue
            drafter = self.private if req.params.cache_salt else self.drafter
            req.draft = drafter.propose(req.rid, req.tokens, k)
            spare -= len(req.draft)
            drafting = drafting or bool(req.draft)
        return drafting

    @staticmethod
    def may_draft(params) -> bool:
        """Whether a request with these parameters ever drafts. Not when it opted out, nor
        when it samples under a seed: whether a step drafts depends on the batch (and a
        suffix drafter on other requests), and rejection sampling draws its uniforms
        differently from a plain step, so a seeded request's tokens would depend on the
        load; without drafts they depend only on its seed."""
        if not getattr(params, "speculate", True):
            return False
        return params.seed is None or params.temperature < GREEDY_BELOW

    def observe(self, req, proposed: int, accepted: int) -> None:
        """A verified step of `req`: `accepted` of its `proposed` drafts kept."""
        state, start = req.backoff, self.config.num_speculative_tokens
        width = state.width or start
        if accepted < proposed:
            state.width = start
        elif proposed >= width:
            state.width = min(2 * width, max(self.config.max_speculative_tokens, start))
        state.observe(proposed, accepted)
        self.stats.observe(proposed, accepted)

    def finished(self, req, learn: bool) -> None:
        """`req` left the engine: with `learn`, a shared drafter learns its output (not a
        salted request's, nor one that opted out of speculation)."""
        if self.drafter is None:
            return
        self.private.forget(req.rid)
        p = req.params
        if learn and not p.cache_salt and getattr(p, "speculate", True):
            # A shared drafter learns at most the last LEARN_MAX_TOKENS tokens (it costs a
            # few microseconds a token, in the scheduler's step loop).
            tokens = req.tokens
            cut = max(len(tokens) - LEARN_MAX_TOKENS, 0)
            self.drafter.finished(req.rid, tokens[cut:], max(len(req.prompt_ids) - cut, 0))
        else:
            self.drafter.forget(req.rid)
