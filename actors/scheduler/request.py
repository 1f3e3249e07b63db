"""The scheduler's view of one request: its tokens, its parameters, where it is in its life.

KV facts here (`committed`, `row`, `admitted`) mirror the allocator's record of the request:
they are set only from the allocator's replies (grants, decode slots, retraction), never
computed on their own, so the scheduler can plan without asking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.speculation.policy import DraftBackoff
from transport.messages.engine import GenerationParams


@dataclass(eq=False)
class Req:
    rid: int
    prompt_ids: list[int]
    params: GenerationParams
    eos_ids: frozenset[int]
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    # Mirror of the allocator's record: positions whose KV is computed, and the row.
    committed: int = 0
    row: int = -1
    admitted: bool = False  # holds KV (a row and slots)
    registered: bool = False  # the runner holds its sampler state
    cached_tokens: int = -1  # prompt tokens served from the prefix cache, set at admission
    cached_reported: bool = False
    retractions: int = 0
    arrived_at: float = 0.0  # time.monotonic() at submit
    queued_s: float = -1.0  # seconds from submit to its first admission
    prompt_lp_next: int = 1  # with prompt_logprobs: the next prompt token whose logprob is due
    session_id: str = ""  # a streaming session's turn (its KV is restored and saved)
    staging: bool = False  # its session's KV is being read ahead from disk: not admitted yet
    grammar_key: str = ""  # its constraint's compiled grammar, held by the runner by this key
    # Speculative decoding: this step's draft tokens (their slots reserved, not committed)
    draft: list[int] = field(default_factory=list)
    backoff: DraftBackoff = field(default_factory=DraftBackoff)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new(self) -> int:
        return max(self.params.max_tokens - len(self.output_ids), 0)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (first admission only; never after retraction)."""
        return self.params.prompt_logprobs is not None and self.prompt_lp_next < len(
            self.prompt_ids
        )

    @property
    def prefill_left(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return self.num_tokens - self.committed
