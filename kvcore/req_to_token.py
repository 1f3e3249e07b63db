"""The req-to-token table: one row of slot ids per live request.

Row r, position i holds the slot where token i of the request that holds row r
keeps its KV. Row 0 is reserved (padding for batched kernels); rows
1..num_rows are handed out. Entries outside a request's allocated length are
meaningless (kept at 0, the padding slot).
"""

from __future__ import annotations

import numpy as np


class RowError(Exception):
    """A misuse of the table (double free, foreign row, write past capacity)."""


class ReqToTokenTable:
    def __init__(self, num_rows: int, row_capacity: int) -> None:
        if num_rows < 1 or row_capacity < 1:
            raise ValueError("num_rows and row_capacity must be >= 1")
        self.num_rows = num_rows
        self.row_capacity = row_capacity
        self.table = np.zeros((num_rows + 1, row_capacity), dtype=np.int64)
        self._free_rows = list(range(num_rows, 0, -1))
        self._held = np.zeros(num_rows + 1, dtype=bool)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._held[row] = True
        return row

    def free_row(self, row: int) -> None:
        self._check_held(row)
        self._held[row] = False
        self.table[row, :] = 0
        self._free_rows.append(row)

    def is_held(self, row: int) -> bool:
        return 1 <= row <= self.num_rows and bool(self._held[row])

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        self._check_held(row)
        end = start + len(slots)
        if start < 0 or end > self.row_capacity:
            raise RowError(f"write [{start}, {end}) outside row capacity {self.row_capacity}")
        self.table[row, start:end] = slots

    def read(self, row: int, start: int, end: int) -> np.ndarray:
        self._check_held(row)
        return self.table[row, start:end].copy()

    def held_rows(self) -> np.ndarray:
        return np.nonzero(self._held)[0]

    def _check_held(self, row: int) -> None:
        if not self.is_held(row):
            raise RowError(f"row {row} is not held")
