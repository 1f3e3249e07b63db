"""The per-request KV record (the seeds' `ReqKvInfo` contract).

One record lives for the whole life of a request and is never replaced by
None: releasing it zeroes its lengths (`mark_released`). Only the allocator's
code paths write its fields; `tests/unit/test_ownership_audit.py` pins every site.

Invariant (checked by `kvcore.invariants`):
    0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <= row capacity
and at every release point `not is_held == is_released`.

The write guard: with `enable_write_guard()` (on in tests and under `engine.debug_checks`)
a record is writable only inside `ledger_writes()`, the context the ledger's methods run
in. The guard sits in the fields' own descriptors, so every spelling of a write
(`r.f = v`, `setattr`, `ReqKvInfo.f.__set__(r, v)`, `r.__init__(...)`, `mark_released()`,
`dataclasses`-style replacement through the constructor) goes through it, and a record can
never be copied (a second live record for one row is SGLang #20476's bug). The context is
a `ContextVar`, so another task running on the same event loop while a ledger method
awaits is not inside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

FIELDS = (
    "req_pool_idx",
    "cache_protected_len",
    "kv_committed_len",
    "kv_allocated_len",
    "swa_evict_floor",
    "swa_evicted_seqlen",
)

_writing: ContextVar[bool] = ContextVar("kvactor_ledger_writes", default=False)
_guard = [False]  # one flag for the process: tests and debug mode switch it on


class RecordWriteOutsideLedger(RuntimeError):
    """A `ReqKvInfo` field was written (or a record copied) outside the ledger's context."""


def enable_write_guard(on: bool = True) -> None:
    _guard[0] = on


def write_guard_enabled() -> bool:
    return _guard[0]


@contextmanager
def ledger_writes() -> Iterator[None]:
    """The context in which records may be written (the ledger's methods; tests that plant
    a broken state on purpose)."""
    token = _writing.set(True)
    try:
        yield
    finally:
        _writing.reset(token)


def _check_writer(what: str) -> None:
    if _guard[0] and not _writing.get():
        raise RecordWriteOutsideLedger(f"{what} outside the ledger's context")


class _Field:
    """A record field whose every write passes the guard; the value lives in a slot that
    only this descriptor holds (the class keeps no name for it)."""

    __slots__ = ("name", "_storage")

    def __init__(self, name: str, storage) -> None:
        self.name = name
        self._storage = storage

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return self._storage.__get__(obj, owner)

    def __set__(self, obj, value) -> None:
        _check_writer(f"write of ReqKvInfo.{self.name}")
        self._storage.__set__(obj, value)

    def __delete__(self, obj) -> None:
        raise RecordWriteOutsideLedger(f"ReqKvInfo.{self.name} cannot be deleted")


class ReqKvInfo:
    __slots__ = tuple(f"_{f}" for f in FIELDS)

    # req-to-token row registering this request's KV; None when no row is held.
    req_pool_idx: int | None
    # positions [0, here) belong to the prefix tree (matched or inserted, locked by this request).
    cache_protected_len: int
    # positions whose KV content is written (or being written by the in-flight forward).
    kv_committed_len: int
    # positions with slots reserved in the row.
    kv_allocated_len: int
    # sliding-window layers: [0, here) is never evicted by the window.
    swa_evict_floor: int
    # sliding-window layers: slots below this cursor are already freed.
    swa_evicted_seqlen: int

    def __init__(
        self,
        req_pool_idx: int | None = None,
        cache_protected_len: int = 0,
        kv_committed_len: int = 0,
        kv_allocated_len: int = 0,
        swa_evict_floor: int = 0,
        swa_evicted_seqlen: int = 0,
    ) -> None:
        self.req_pool_idx = req_pool_idx
        self.cache_protected_len = cache_protected_len
        self.kv_committed_len = kv_committed_len
        self.kv_allocated_len = kv_allocated_len
        self.swa_evict_floor = swa_evict_floor
        self.swa_evicted_seqlen = swa_evicted_seqlen

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

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in FIELDS)
        return f"ReqKvInfo({inner})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, ReqKvInfo):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in FIELDS)

    __hash__ = None  # mutable

    def __copy__(self):
        raise RecordWriteOutsideLedger("a ReqKvInfo is never copied (one record per request)")

    def __deepcopy__(self, memo):
        raise RecordWriteOutsideLedger("a ReqKvInfo is never copied (one record per request)")

    def __reduce_ex__(self, protocol):
        raise RecordWriteOutsideLedger("a ReqKvInfo is never copied or pickled")

    def __setattr__(self, name: str, value) -> None:
        if name not in FIELDS:
            raise AttributeError(f"ReqKvInfo has no field {name!r}")
        object.__setattr__(self, name, value)


# Each field's storage slot is reachable only through its guarded descriptor.
for _name in FIELDS:
    _storage = ReqKvInfo.__dict__[f"_{_name}"]
    delattr(ReqKvInfo, f"_{_name}")
    setattr(ReqKvInfo, _name, _Field(_name, _storage))
del _name, _storage
