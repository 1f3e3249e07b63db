"""Shared helpers for driving the allocator's KvLedger in tests without an event loop.

`LocalPrefixPort` never suspends, so a ledger coroutine can be run to completion
with a single `send(None)`. `FakeKv` plays the model runner: it records which token
each slot holds so tests can check that the prefix tree maps tokens to the KV that
was actually written for them. With a sliding pool it also keeps the runner's replica
of the full -> sliding page map (applied from the `SwaMapDelta`s the ledger returns, in
list order; a sliding page 0 unmaps) and the sliding layers' KV, written and read
through that replica as the runner would.
"""

from __future__ import annotations

import numpy as np

from actors.allocator.ledger import KvLedger, SlotDelta
from actors.allocator.prefix_port import LocalPrefixPort, run_sync  # noqa: F401 (re-exported)
from kvcore import PagePool, RadixTree, ReqToTokenTable
from kvcore.prefix_digest import prefix_hashes


def make_ledger(
    num_pages: int,
    page_size: int,
    rows: int,
    capacity: int,
    radix: bool = True,
    cls=KvLedger,
    **tree_options,
):
    """A ledger on fresh pools, and its prefix tree (`tree_options`: RadixTree's)."""
    tree = RadixTree(page_size, **tree_options) if radix else None
    ledger = cls(
        PagePool(num_pages, page_size),
        ReqToTokenTable(rows, capacity),
        LocalPrefixPort(tree) if radix else None,
    )
    return ledger, tree


def is_map_delta(delta) -> bool:
    """A `SwaMapDelta` (duck-typed: a mutant ledger module has classes of its own)."""
    return hasattr(delta, "swa_pages")


class FakeKv:
    """slot -> (token, position) written there, as a model runner would.

    With `swa_pages`, the sliding layers too: `swa_map` is the runner's replica of the
    full -> sliding page map and `swa_token` / `swa_pos` the sliding KV, written at
    `swa_map[slot // page_size] * page_size + slot % page_size`.
    """

    def __init__(self, num_slots: int, page_size: int = 1, swa_pages: int = 0) -> None:
        self.token = np.full(num_slots, -1, dtype=np.int64)
        self.pos = np.full(num_slots, -1, dtype=np.int64)
        self.replica: dict[int, np.ndarray] = {}
        self.page_size = page_size
        self.swa_map = np.zeros(num_slots // page_size, dtype=np.int64) if swa_pages else None
        swa_slots = (swa_pages + 1) * page_size if swa_pages else 0
        self.swa_token = np.full(swa_slots, -1, dtype=np.int64)
        self.swa_pos = np.full(swa_slots, -1, dtype=np.int64)

    def apply(self, deltas: list[SlotDelta], capacity: int) -> None:
        for d in deltas:
            if is_map_delta(d):
                assert self.swa_map is not None, "a sliding-page delta without a sliding pool"
                self.swa_map[np.asarray(d.full_pages, dtype=np.int64)] = d.swa_pages
                continue
            row = self.replica.setdefault(d.row, np.zeros(capacity, dtype=np.int64))
            row[d.start : d.start + len(d.slots)] = d.slots

    def write(self, row: int, tokens: np.ndarray, start: int, end: int) -> None:
        slots = self.replica[row][start:end]
        self.token[slots] = tokens[start:end]
        self.pos[slots] = np.arange(start, end)
        if self.swa_map is not None:
            swa = self.sliding_slots(slots)
            have = swa >= self.page_size  # unmapped: the runner writes the padding page
            self.swa_token[swa[have]] = tokens[start:end][have]
            self.swa_pos[swa[have]] = np.arange(start, end)[have]

    def sliding_slots(self, slots: np.ndarray) -> np.ndarray:
        """Where the runner keeps the sliding KV of these (full) slots; < page_size when
        their page has no sliding page in its replica."""
        ps = self.page_size
        return self.swa_map[slots // ps] * ps + slots % ps

    def assert_row_holds(self, row: int, tokens: np.ndarray, n: int) -> None:
        slots = self.replica[row][:n]
        assert (self.token[slots] == tokens[:n]).all(), "row maps tokens to foreign KV"
        assert (self.pos[slots] == np.arange(n)).all(), "row maps positions to foreign KV"


class RequestViews:
    """The property machines' views of their requests (`self.tokens`: rid -> every token
    known for it) through the ledger's records."""

    def _rec(self, rid):
        return self.ledger.records.get(rid)

    def _held(self):
        return [r for r in self.tokens if self._rec(r) is not None and self._rec(r).is_held]

    def _prefilling(self):
        return [r for r in self._held() if self._rec(r).kv_committed_len < len(self.tokens[r])]

    def _decoding(self):
        """Held requests with every known token in KV and no draft slots reserved."""
        return [
            r
            for r in self._held()
            if self._rec(r).kv_committed_len == len(self.tokens[r]) == self._rec(r).kv_allocated_len
        ]

    def _not_done(self):
        return [
            r
            for r in self.tokens
            if self._rec(r) is None
            or not self._rec(r).is_held
            or self._rec(r).kv_committed_len < len(self.tokens[r])
        ]


class FakeTierPort:
    """The runner's host store over a `FakeKv`: a save copies the tokens and positions the
    slots hold, a load writes them back at the slots given (so a wrong slot, position or
    sliding entry shows as foreign KV). Sizes: 8 bytes per saved full position and per saved
    sliding position. `fail` names the operations that raise, as a runner that cannot copy."""

    def __init__(self, kv: FakeKv) -> None:
        self.kv = kv
        self.entries: dict[int, tuple[list[np.ndarray], int]] = {}
        self.fail: set[str] = set()
        self.loads: list[tuple[int, int, int]] = []  # (handle, start, positions) per load
        self.on_disk: set[int] = set()  # handles spilled to the "disk" tier

    async def save(self, handle: int, full_slots: np.ndarray, swa_slots: np.ndarray) -> int:
        if "save" in self.fail:
            raise RuntimeError("save failed")
        kv = self.kv
        full, swa = np.asarray(full_slots), np.asarray(swa_slots, dtype=np.int64)
        parts = [kv.token[full].copy(), kv.pos[full].copy()]
        parts += [kv.swa_token[swa].copy(), kv.swa_pos[swa].copy()]
        nbytes = 8 * (len(full) + len(swa))
        self.entries[handle] = (parts, nbytes)
        return nbytes

    async def load(self, handle, start, full_slots, swa_index, swa_slots) -> None:
        if "load" in self.fail:
            raise RuntimeError("load failed")
        parts, _ = self.entries[handle]
        kv, full = self.kv, np.asarray(full_slots)
        kv.token[full] = parts[0][start : start + len(full)]
        kv.pos[full] = parts[1][start : start + len(full)]
        index, swa = np.asarray(swa_index, dtype=np.int64), np.asarray(swa_slots, dtype=np.int64)
        kv.swa_token[swa] = parts[2][index]
        kv.swa_pos[swa] = parts[3][index]
        self.loads.append((handle, start, len(full)))

    async def spill(self, handle: int) -> int:
        """To the 'disk': half the bytes (a compressed file, say), same contents; a handle
        already there: its size (a spill that joins the write under way)."""
        if "spill" in self.fail:
            raise RuntimeError("spill failed")
        parts, nbytes = self.entries[handle]
        if handle in self.on_disk:
            return nbytes
        self.entries[handle] = (parts, nbytes // 2)
        self.on_disk.add(handle)
        return nbytes // 2

    async def drop(self, handles: list[int]) -> None:
        if "drop" in self.fail:
            raise RuntimeError("drop failed")
        for h in handles:
            self.entries.pop(h, None)
            self.on_disk.discard(h)

    async def contents(self) -> dict[int, tuple[str, int]]:
        return {
            h: ("disk" if h in self.on_disk else "host", nbytes)
            for h, (_, nbytes) in self.entries.items()
        }


def expected_dead_ends(tree: RadixTree, resumable) -> set[int]:
    """The tree's dead ends by brute force: every whole digest block of every unsalted
    path, kept where `resumable(path_slots, path_alive, end)` says no request resumes right
    after the block's end (`path_alive`: per page of the path)."""
    snap = tree.snapshot()
    index = {nid: i for i, nid in enumerate(snap.ids)}
    block, out = tree.digest_block, set()
    for i, nid in enumerate(snap.ids):
        chain = []
        while nid != RadixTree.ROOT_ID:
            chain.append(index[nid])
            nid = snap.parents[index[nid]]
        chain.reverse()
        key = np.concatenate([snap.keys[j] for j in chain])
        if int(key[0]) >> 32:
            continue  # a salted namespace: not in the digest
        slots = np.concatenate([snap.values[j] for j in chain])
        alive = np.concatenate([snap.alive[j] for j in chain])
        depth = len(key) - len(snap.keys[i])
        for k, h in enumerate(prefix_hashes(key, block)):
            end = (k + 1) * block
            if end > depth and not resumable(slots, alive, end):
                out.add(h)
    return out
