"""Shared helpers for driving the allocator's KvLedger in tests without an event loop.

`LocalPrefixPort` never suspends, so a ledger coroutine can be run to completion
with a single `send(None)`. `FakeKv` plays the model runner: it records which token
each slot holds so tests can check that the prefix tree maps tokens to the KV that
was actually written for them.
"""

from __future__ import annotations

import numpy as np

from actors.allocator.ledger import KvLedger, SlotDelta
from actors.allocator.prefix_port import LocalPrefixPort, run_sync  # noqa: F401 (re-exported)
from kvcore import PagePool, RadixTree, ReqToTokenTable


def make_ledger(
    num_pages: int, page_size: int, rows: int, capacity: int, radix: bool = True, cls=KvLedger
):
    tree = RadixTree(page_size) if radix else None
    ledger = cls(
        PagePool(num_pages, page_size),
        ReqToTokenTable(rows, capacity),
        LocalPrefixPort(tree) if radix else None,
    )
    return ledger, tree


class FakeKv:
    """slot -> (token, position) written there, as a model runner would."""

    def __init__(self, num_slots: int) -> None:
        self.token = np.full(num_slots, -1, dtype=np.int64)
        self.pos = np.full(num_slots, -1, dtype=np.int64)
        self.replica: dict[int, np.ndarray] = {}

    def apply(self, deltas: list[SlotDelta], capacity: int) -> None:
        for d in deltas:
            row = self.replica.setdefault(d.row, np.zeros(capacity, dtype=np.int64))
            row[d.start : d.start + len(d.slots)] = d.slots

    def write(self, row: int, tokens: np.ndarray, start: int, end: int) -> None:
        slots = self.replica[row][start:end]
        self.token[slots] = tokens[start:end]
        self.pos[slots] = np.arange(start, end)

    def assert_row_holds(self, row: int, tokens: np.ndarray, n: int) -> None:
        slots = self.replica[row][:n]
        assert (self.token[slots] == tokens[:n]).all(), "row maps tokens to foreign KV"
        assert (self.pos[slots] == np.arange(n)).all(), "row maps positions to foreign KV"
