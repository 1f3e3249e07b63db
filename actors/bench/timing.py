"""The one timing loop every benchmark uses, and the statistics it reports.

`time_calls` runs a callable `warmup` times untimed, then `repeats` times under
`time.perf_counter`; `time_calls_async` does the same for a coroutine function. Both return
`Timings`, whose `best` is the least disturbed run on a shared machine and whose `median`
and percentiles describe the spread. Benchmarks print; they never assert (tests don't
import this package).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kernels.timing import timed_runs


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, `q` in [0, 1]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass(frozen=True)
class Timings:
    """Seconds per run."""

    samples: list[float]

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    def p(self, q: float) -> float:
        return percentile(self.samples, q)

    def summary_us(self) -> str:
        return f"median {self.median * 1e6:7.1f} us   p99 {self.p(0.99) * 1e6:7.1f} us"


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> Timings:
    return Timings(timed_runs(fn, repeats, warmup))


async def time_calls_async(
    fn: Callable[[], Awaitable[object]], repeats: int, warmup: int = 1
) -> Timings:
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return Timings(samples)
