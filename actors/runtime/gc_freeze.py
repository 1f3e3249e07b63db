"""Long-lived objects out of the garbage collector's way (as vLLM and SGLang do).

Loading a model and compiling its steps leave hundreds of thousands of objects that live as
long as the engine. Every full collection walks all of them while holding the GIL: on the
embedded model 200-300 ms each, three of them while the steps compile in the background, so
the requests served meanwhile stalled. `freeze_survivors` collects once, then moves every
object alive into the permanent generation, which collections skip; `thaw` moves them back,
so that a stopping engine's reference cycles (the runner and its cell, the LM head and its
kernels) can be collected again.

Freezing is per process and covers every object alive, whoever made it: the lock keeps a
freeze from landing after a thaw that was meant to follow it. So is thawing: with several
engines in one process, one engine's stop thaws the others' objects too, and their full
collections walk them again until a runner freezes next (a cost, not a fault).
"""

from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()


def freeze_survivors(still_wanted=lambda: True) -> dict[str, float] | None:
    """Collect, then freeze every object alive; None (nothing done) unless `still_wanted()`
    holds under the lock. Returns what was frozen and how long it took (for the log)."""
    with _lock:
        if not still_wanted():
            return None
        start = time.perf_counter()
        gc.collect()
        gc.freeze()
        ms = (time.perf_counter() - start) * 1e3
        return {"frozen": gc.get_freeze_count(), "ms": round(ms, 1)}


def thaw() -> None:
    """Every frozen object back under collection (then a `gc.collect` can free cycles)."""
    with _lock:
        gc.unfreeze()
