"""KV below the pool: the tiers' entries and their accounting (pure bookkeeping).

A session whose KV is demoted holds no record, no row and no pool page: its history's KV
lives in a tier under a handle, and the allocator's ledger keeps the `TierEntry` that says
what the bytes are (the token keys they belong to, which pages had sliding KV). The bytes
themselves are the model runner's (`kernels.kv_store`).

Tiers: "host" (RAM) and "disk" (files under `kv.store_dir`), each with a byte budget; an
entry is in one of them, and moves host -> disk when the host tier overflows.

Two kinds of entry. A session's (`start` 0): its whole history, owned by its slot. A prefix
block's: the KV of positions [start, end) of a prefix-tree node the pool evicted, owned by
the `PrefixIndex`, which finds it again for any request whose tokens [0, end) are the
block's (the KV at a position depends on the tokens up to it, nothing else).

Invariants (`check_tiers`):
  * every entry is in exactly one tier and has exactly one owner: a session slot or the
    prefix index; a slot names at most one entry, and never holds a pool record and an
    entry at once (nothing is owned twice across tiers);
  * each tier's byte count is the sum of its entries' sizes and never above its budget;
  * where the runner's store is audited too, it holds exactly these handles, in these
    tiers, at these sizes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvcore.slots import ceil_page, floor_page


class TierViolation(AssertionError):
    pass


@dataclass(slots=True)
class TierEntry:
    """KV for positions [start, len(tokens)) held outside the pool (a session's: start 0)."""

    handle: int
    tokens: np.ndarray  # prefix-cache keys of positions [0, len(tokens))
    # Per logical page of [0, len(tokens)): its sliding KV was saved (None: one pool, the
    # sliding layers' KV is the full slots'). A prefix block saves every page's.
    alive: np.ndarray | None
    nbytes: int
    last_used: int = 0
    start: int = 0  # the first stored position (a page multiple)
    loads: int = 0  # a prefix block's: admissions that loaded it

    @property
    def length(self) -> int:
        return len(self.tokens)

    def saved_swa_positions(self, page_size: int) -> np.ndarray:
        """The positions whose sliding KV was saved, in the store's order."""
        if self.alive is None:
            return np.zeros(0, dtype=np.int64)
        per_position = np.repeat(self.alive, page_size)[: self.length]
        return np.flatnonzero(per_position)


@dataclass
class KvTier:
    """One tier's entries and bytes, under a byte budget ("host": RAM, "disk": files)."""

    name: str
    budget: int
    entries: dict[int, TierEntry] = field(default_factory=dict)
    used: int = 0

    def add(self, entry: TierEntry) -> None:
        if entry.handle in self.entries:
            raise TierViolation(f"handle {entry.handle} is stored twice")
        self.entries[entry.handle] = entry
        self.used += entry.nbytes

    def remove(self, handle: int) -> TierEntry:
        entry = self.entries.pop(handle)
        self.used -= entry.nbytes
        return entry

    def over_budget(self) -> bool:
        return self.used > self.budget

    def least_recent(self) -> list[int]:
        """Handles, least recently used first."""
        return sorted(self.entries, key=lambda h: self.entries[h].last_used)


class PrefixIndex:
    """Prefix blocks by the hash of their tokens [0, start + page): `plan_block_loads` walks
    a request's tokens block by block from where the prefix tree's match ended."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.handles: dict[bytes, int] = {}
        self.keys: dict[int, bytes] = {}  # handle -> its key

    def __contains__(self, handle: int) -> bool:
        return handle in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def key_of(self, tokens: np.ndarray, start: int) -> bytes:
        head = np.ascontiguousarray(tokens[: start + self.page_size], dtype=np.int64)
        return hashlib.blake2b(head.tobytes(), digest_size=16).digest()

    def get(self, tokens: np.ndarray, start: int) -> int | None:
        return self.handles.get(self.key_of(tokens, start))

    def add(self, entry: TierEntry) -> None:
        key = self.key_of(entry.tokens, entry.start)
        if key in self.handles:
            raise TierViolation(f"a prefix block at {entry.start} is indexed twice")
        self.handles[key] = entry.handle
        self.keys[entry.handle] = key

    def remove(self, handle: int) -> None:
        del self.handles[self.keys.pop(handle)]


@dataclass(frozen=True)
class BlockLoad:
    """Positions [start, end) of a request loaded from prefix block `handle`."""

    handle: int
    start: int
    end: int


def plan_block_loads(
    index: PrefixIndex,
    entry_of: Callable[[int], TierEntry | None],
    tokens: np.ndarray,
    cached: int,
) -> list[BlockLoad]:
    """The prefix blocks that continue `tokens` from `cached` (page-aligned, where the
    prefix tree's match ended), as far as whole pages of `tokens` match; a block's every
    page has its sliding KV, so a load never leaves the window a query reads without it."""
    ps = index.page_size
    limit = floor_page(len(tokens), ps)
    loads: list[BlockLoad] = []
    pos = cached
    while pos + ps <= limit:
        handle = index.get(tokens, pos)
        entry = entry_of(handle) if handle is not None else None
        if entry is None or entry.start != pos:
            break
        head = min(entry.length, limit)
        if not np.array_equal(entry.tokens[:pos], tokens[:pos]):
            break  # a hash collision: not this request's prefix
        same = entry.tokens[pos:head] == tokens[pos:head]
        n = floor_page(int(np.argmin(same)) if not same.all() else len(same), ps)
        if n == 0:
            break
        loads.append(BlockLoad(handle, pos, pos + n))
        pos += n
        if pos < entry.length:
            break
    return loads


@dataclass(frozen=True)
class Promotion:
    """What a new turn can take from a stored entry: positions [cached, length) loaded,
    and the record's window fields (the pages [dead_from, dead_to) had no sliding KV)."""

    length: int
    dead_from: int
    dead_to: int


def plan_promotion(
    entry: TierEntry, prefix_len: int, cached: int, window: int, page_size: int
) -> Promotion | None:
    """A turn whose first `prefix_len` tokens equal the entry's, and whose first `cached`
    (page-aligned) come from the prefix tree, loads [cached, prefix_len) from the entry, if:
    it gains something; the window the first computed position reads has sliding KV on the
    entry's pages (the tree's part of it was checked by the tree match); and the entry's
    pages without sliding KV in the loaded range are one run, as a record's freed range is.
    None: prefill instead."""
    n = min(prefix_len, entry.length)
    if n <= cached:
        return None
    if entry.alive is None or not window:
        return Promotion(n, cached, cached)
    ps = page_size
    first_page, last_page = cached // ps, ceil_page(n, ps) // ps
    alive = np.asarray(entry.alive[first_page:last_page], dtype=bool)
    read_from = max(n - window + 1, cached) // ps - first_page
    if not alive[read_from:].all():
        return None
    dead = np.flatnonzero(~alive)
    if dead.size == 0:
        return Promotion(n, cached, cached)
    if dead[-1] - dead[0] + 1 != dead.size:
        return None
    return Promotion(n, (first_page + int(dead[0])) * ps, (first_page + int(dead[-1]) + 1) * ps)


def check_tiers(
    tiers: list[KvTier],
    slot_entries: Mapping[object, int],
    slots_with_records: set,
    store: Mapping[int, tuple[str, int]] | None = None,
    prefix_blocks: PrefixIndex | None = None,
) -> None:
    """The tiers' invariants (module docstring). `slot_entries`: session -> the handle its
    slot names; `slots_with_records`: sessions whose slot holds a pool record; `store`: the
    runner's handle -> (tier name, bytes), when audited; `prefix_blocks`: the index that
    owns the prefix blocks."""
    where: dict[int, str] = {}
    for tier in tiers:
        for handle in tier.entries:
            if handle in where:
                raise TierViolation(
                    f"handle {handle} is in the {where[handle]} and {tier.name} tiers"
                )
            where[handle] = tier.name
    owners: dict[int, object] = {}
    if prefix_blocks is not None:
        inverse = {h: k for k, h in prefix_blocks.handles.items()}
        if inverse != prefix_blocks.keys:
            raise TierViolation("the prefix index's keys and handles disagree")
    for handle in prefix_blocks.keys if prefix_blocks is not None else ():
        if handle not in where:
            raise TierViolation(f"the prefix index names handle {handle}, which is not stored")
        entry = next(t.entries[handle] for t in tiers if handle in t.entries)
        if prefix_blocks.keys[handle] != prefix_blocks.key_of(entry.tokens, entry.start):
            raise TierViolation(f"prefix block {handle} is indexed under another prefix")
        ps = prefix_blocks.page_size
        if entry.start % ps or entry.length % ps or not entry.start < entry.length:
            raise TierViolation(
                f"prefix block {handle} holds [{entry.start}, {entry.length}), not whole pages"
            )
        owners[handle] = "the prefix index"
    for sid, handle in slot_entries.items():
        if handle not in where:
            raise TierViolation(f"session {sid!r} names handle {handle}, which is not stored")
        if handle in owners:
            raise TierViolation(f"handle {handle} belongs to {owners[handle]!r} and {sid!r}")
        owners[handle] = sid
        if sid in slots_with_records:
            raise TierViolation(f"session {sid!r} holds pool KV and a stored entry at once")
    orphans = sorted(set(where) - set(owners))
    if orphans:
        raise TierViolation(f"stored handles {orphans[:8]} belong to no session")
    for tier in tiers:
        total = sum(e.nbytes for e in tier.entries.values())
        if total != tier.used:
            raise TierViolation(
                f"{tier.name} tier counts {tier.used} bytes; its entries hold {total}"
            )
        if tier.used > tier.budget:
            raise TierViolation(
                f"{tier.name} tier holds {tier.used} bytes, over its {tier.budget} budget"
            )
    if store is not None:
        expected = {h: (where[h], e.nbytes) for t in tiers for h, e in t.entries.items()}
        if dict(store) != expected:
            missing = sorted(set(expected) - set(store))
            extra = sorted(set(store) - set(expected))
            wrong = sorted(h for h in set(store) & set(expected) if store[h] != expected[h])
            raise TierViolation(
                f"the runner's store disagrees with the ledger: missing {missing[:8]}, "
                f"unknown {extra[:8]}, other tier or size {wrong[:8]}"
            )
