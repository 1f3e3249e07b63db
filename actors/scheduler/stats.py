"""The scheduler's histogram of tokens per step, exported as `vllm:iteration_tokens_total`.

The scheduler keeps one count per bucket (not cumulative) and the sum and number of steps:
`observe` is a bisect and one increment, whatever the batch, so a step costs O(log buckets)
more. `cumulative` (once per stats query, i.e. per scrape) turns the counts into
Prometheus' cumulative `le` buckets.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Sequence

# vLLM's bucket bounds of `vllm:iteration_tokens_total` (vllm/v1/metrics/loggers.py).
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenHistogram:
    """Tokens per engine step; a step of `n` tokens falls in the first bucket with bound >= n
    (past the largest bound: only in +Inf, i.e. in `count`)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[int] = STEP_TOKEN_BOUNDS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must increase strictly, got {list(bounds)}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0
        self.count = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect_left(self.bounds, tokens)] += 1
        self.sum += tokens
        self.count += 1

    def cumulative(self) -> list[int]:
        """Steps with at most `bounds[i]` tokens, per bound (+Inf is `count`)."""
        return list(itertools.accumulate(self.counts[:-1]))
