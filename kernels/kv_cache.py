"""Paged KV storage on the device and the device replica of the req-to-token table.

`KVCache` holds, per layer, K and V rows indexed by slot id, where
slot = page * page_size + offset. Page 0 is reserved for padding: its slots are never
handed to a request, so kernels may point padded lanes at slot 0 and read garbage that a
mask discards. Layout is NHD ([slot, kv_head, head_dim]); `paged(layer)` views the same
memory as [num_pages, page_size, kv_head, head_dim], the layout FlashInfer's paged wrappers
read.

`ReqToTokenTable` is the runner's copy of the allocator's rows: row r, position p -> slot.
The allocator owns the truth; the runner only applies the deltas that ride with each batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


class KVCache:
    """K and V tensors for every layer: [num_layers, num_slots, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 1,
    ) -> None:
        if num_slots % page_size != 0:
            raise ValueError("num_slots must be a whole number of pages")
        if num_slots < 2 * page_size:
            raise ValueError("need at least one usable page besides the reserved page 0")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def first_valid_slot(self) -> int:
        """Slots below this belong to the reserved padding page 0."""
        return self.page_size

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()

    def layer_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.k[layer], self.v[layer]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k/v [T, num_kv_heads, head_dim] at `slots` [T] (int64) of `layer`."""
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def paged(self, layer: int) -> tuple[Tensor, Tensor]:
        """K and V of `layer` viewed as [num_pages, page_size, num_kv_heads, head_dim]."""
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)


class ReqToTokenTable:
    """int32 [num_rows, row_capacity]: slot of each (row, position); 0 where unset."""

    def __init__(
        self, num_rows: int, row_capacity: int, device: torch.device | str = "cpu"
    ) -> None:
        self.num_rows = num_rows
        self.row_capacity = row_capacity
        self.device = torch.device(device)
        self.table = torch.zeros((num_rows, row_capacity), dtype=torch.int32, device=self.device)

    def apply_slot_deltas(
        self,
        rows: Sequence[int] | np.ndarray,
        starts: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        flat_slots: Sequence[int] | np.ndarray | Tensor,
    ) -> None:
        """table[rows[i], starts[i] : starts[i] + lengths[i]] = the i-th run of flat_slots.

        `flat_slots` is the concatenation of all runs, in the order of `rows`.
        """
        rows_np = np.asarray(rows, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        lengths_np = np.asarray(lengths, dtype=np.int64)
        total = int(lengths_np.sum()) if lengths_np.size else 0
        slots = torch.as_tensor(flat_slots, dtype=torch.int32).reshape(-1)
        if slots.numel() != total:
            raise ValueError(f"{slots.numel()} slots for runs of total length {total}")
        if total == 0:
            return
        if (starts_np < 0).any() or (starts_np + lengths_np > self.row_capacity).any():
            raise ValueError("slot delta runs past the row capacity")
        if (rows_np < 0).any() or (rows_np >= self.num_rows).any():
            raise ValueError("slot delta names a row outside the table")
        run_starts_flat = np.cumsum(lengths_np) - lengths_np
        row_idx = np.repeat(rows_np, lengths_np)
        col_shift = np.repeat(starts_np - run_starts_flat, lengths_np)
        col_idx = np.arange(total, dtype=np.int64) + col_shift
        self.table[torch.from_numpy(row_idx), torch.from_numpy(col_idx)] = slots.to(self.device)

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Zero whole rows (debug hygiene; stale entries past a row's length are never read)."""
        self.table[torch.as_tensor(list(rows), dtype=torch.int64)] = 0
