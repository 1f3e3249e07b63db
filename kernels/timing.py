"""The timing loop behind every run-time calibration in `kernels` (the int8 check, the
LM head's `calibrate` plan) and every benchmark (`actors/bench/timing.py` wraps it)."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed_runs(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples
