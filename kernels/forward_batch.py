"""One forward step's input: a ragged batch of prefill chunks and decode tokens.

A `ForwardBatch` is plain Python (it arrives from the scheduler side). For each request:
  * `row`        its req-to-token row,
  * `prefix_len` positions [0, prefix_len) whose KV is already in the cache,
  * `input_ids`  the new tokens (1 for decode, a chunk for prefill), at positions
                 prefix_len + arange(len(input_ids)); their K/V go to the slots
                 req_to_token[row, prefix_len : prefix_len + extend] (set by the deltas),
  * `need_logits` whether to return logits for its last new token (False for a non-final
                 prefill chunk).
`slot_deltas` optionally carries the allocator's req-to-token updates for this step; the
executor applies them before reading the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SlotDeltas:
    """Runs of slots to write into the req-to-token table: row[i][start[i] : +length[i]]."""

    rows: Sequence[int]
    starts: Sequence[int]
    lengths: Sequence[int]
    flat_slots: Sequence[int] | np.ndarray
    # New full -> sliding page mappings (split KV pools only): map[swa_full_pages[i]] = ...
    swa_full_pages: Sequence[int] = ()
    swa_pages: Sequence[int] = ()


@dataclass
class ForwardBatch:
    """A ragged batch; derived lengths are computed once in __post_init__ with numpy."""

    rows: list[int]
    prefix_lens: list[int]
    input_ids: list[list[int]]
    need_logits: list[bool]
    slot_deltas: SlotDeltas | None = None
    # Derived (not constructor arguments).
    extend_lens: np.ndarray = field(init=False)
    seq_lens: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.rows)
        if not (len(self.prefix_lens) == len(self.input_ids) == len(self.need_logits) == n):
            raise ValueError("rows, prefix_lens, input_ids and need_logits must align")
        if n == 0:
            raise ValueError("empty batch")
        if len(set(self.rows)) != n:
            raise ValueError("a req-to-token row appears twice in one batch")
        self.extend_lens = np.fromiter((len(ids) for ids in self.input_ids), np.int64, n)
        if (self.extend_lens <= 0).any():
            raise ValueError("every request needs at least one new token")
        prefix = np.asarray(self.prefix_lens, dtype=np.int64)
        if (prefix < 0).any():
            raise ValueError("prefix_len must be >= 0")
        self.seq_lens = prefix + self.extend_lens

    @classmethod
    def decode(
        cls,
        rows: list[int],
        seq_lens_before: list[int],
        last_tokens: list[int],
        slot_deltas: SlotDeltas | None = None,
    ) -> ForwardBatch:
        """A pure decode step: one new token per request, logits for all."""
        return cls(
            rows=list(rows),
            prefix_lens=list(seq_lens_before),
            input_ids=[[t] for t in last_tokens],
            need_logits=[True] * len(rows),
            slot_deltas=slot_deltas,
        )

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.extend_lens.sum())

    @property
    def is_decode_only(self) -> bool:
        return bool((self.extend_lens == 1).all())

    @property
    def num_logit_requests(self) -> int:
        return sum(1 for flag in self.need_logits if flag)

    def flat_input_ids(self) -> np.ndarray:
        if self.is_decode_only:
            return np.fromiter((ids[0] for ids in self.input_ids), np.int64, self.batch_size)
        return np.fromiter((t for ids in self.input_ids for t in ids), np.int64, self.num_tokens)
