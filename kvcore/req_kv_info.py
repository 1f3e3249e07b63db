"""The per-request KV record (the seeds' `ReqKvInfo` contract).

One record lives for the whole life of a request and is never replaced by
None: releasing it zeroes its lengths (`mark_released`). Only the allocator's
code paths write its fields; `tests/test_ownership_audit.py` pins every site.

Invariant (checked by `kvcore.invariants`):
    0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <= row capacity
and at every release point `not is_held == is_released`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ReqKvInfo:
    # req-to-token row registering this request's KV; None when no row is held.
    req_pool_idx: int | None = None
    # positions [0, here) belong to the prefix tree (matched or inserted, locked by this request).
    cache_protected_len: int = 0
    # positions whose KV content is written (or being written by the in-flight forward).
    kv_committed_len: int = 0
    # positions with slots reserved in the row.
    kv_allocated_len: int = 0
    # sliding-window layers: [0, here) is never evicted by the window.
    swa_evict_floor: int = 0
    # sliding-window layers: slots below this cursor are already freed.
    swa_evicted_seqlen: int = 0

    @property
    def is_held(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def is_released(self) -> bool:
        return self.kv_allocated_len == 0 and self.swa_evicted_seqlen == 0

    def mark_released(self) -> None:
        """Zero the lengths once the row and every owned page went back (record stays alive)."""
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.swa_evict_floor = 0
        self.swa_evicted_seqlen = 0
