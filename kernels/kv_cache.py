"""Paged KV storage on the device and the device replica of the req-to-token table.

`KVCache` holds, per layer, K and V rows indexed by slot id, where
slot = page * page_size + offset. Page 0 is reserved for padding: its slots are never
handed to a request, so kernels may point padded lanes at slot 0 and read garbage that a
mask discards. Layout is NHD ([slot, kv_head, head_dim]); `paged(layer)` views the same
memory as [num_pages, page_size, kv_head, head_dim], the layout FlashInfer's paged wrappers
read.

With a sliding-window pool (`swa_num_pages` > 0), full-attention layers keep their K/V at
the row's slots and sliding layers in a smaller pool of their own, at the slot the
full-to-sliding page map (`swa_map`, a replica of the allocator's, updated by `map_swa`)
gives: map[slot // page_size] * page_size + slot % page_size. Callers always pass full
slots; `write` and `sliding_slots` translate for sliding layers. The allocator sends every
change, unmappings as page 0, so a full page whose sliding KV was freed reads and writes
the padding page, never a sliding page someone else owns now.

`ReqToTokenTable` is the runner's copy of the allocator's rows: row r, position p -> slot.
The allocator owns the truth; the runner only applies the deltas that ride with each batch.

Both apply their host-side updates through a `HostStaging` each (one transfer per call, no
wait for the device on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from kernels.host_staging import HostStaging

COPY_CHUNK = 4096  # slots per device copy when KV moves to or from a tier


class KVCache:
    """K and V tensors per layer: [num_slots, num_kv_heads, head_dim] (sliding layers:
    [swa_num_slots, ...] when the pools are split)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        sliding_layers: Sequence[int] = (),
        swa_num_pages: int = 0,
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
        split = bool(swa_num_pages) and bool(sliding_layers)
        self.sliding = frozenset(sliding_layers) if split else frozenset()
        full = [i for i in range(num_layers) if i not in self.sliding]
        sliding = sorted(self.sliding)
        # layer -> (its storage, index in it)
        self._where = {layer: (0, k) for k, layer in enumerate(full)}
        self._where.update({layer: (1, k) for k, layer in enumerate(sliding)})
        self.swa_num_slots = (swa_num_pages + 1) * page_size if split else 0
        row = (num_kv_heads, head_dim)
        self._k = [torch.zeros((len(full), num_slots, *row), dtype=dtype, device=self.device)]
        self._v = [torch.zeros((len(full), num_slots, *row), dtype=dtype, device=self.device)]
        if split:
            swa_shape = (len(sliding), self.swa_num_slots, *row)
            self._k.append(torch.zeros(swa_shape, dtype=dtype, device=self.device))
            self._v.append(torch.zeros(swa_shape, dtype=dtype, device=self.device))
        # full page -> sliding page (0: none; page 0 is the padding page of both pools)
        self.swa_map = torch.zeros(
            self.num_pages + 1 if split else 1, dtype=torch.int64, device=self.device
        )
        self.staging = HostStaging(self.device)

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def split(self) -> bool:
        return bool(self.sliding)

    @property
    def first_valid_slot(self) -> int:
        """Slots below this belong to the reserved padding page 0."""
        return self.page_size

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def map_swa(self, full_pages: Sequence[int], swa_pages: Sequence[int]) -> None:
        """Apply the allocator's full -> sliding page map changes (0: unmapped)."""
        if not len(full_pages):
            return
        if not self.split:
            raise ValueError("sliding page mappings for a KV cache without a sliding pool")
        full = np.asarray(full_pages, dtype=np.int64)
        swa = np.asarray(swa_pages, dtype=np.int64)
        if full.shape != swa.shape:
            raise ValueError(f"{full.size} full pages mapped to {swa.size} sliding pages")
        idx, values = self.staging.to_device([full, swa])
        self.swa_map[idx] = values

    def sliding_slots(self, slots: Tensor) -> Tensor:
        """The sliding pool's slot of each (full) slot; identity when the pools are one."""
        if not self.split:
            return slots
        ps = self.page_size
        return self.swa_map[slots // ps] * ps + slots % ps

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor the pool holds (K, V, the sliding map): what a compiled step reads."""
        return (*self._k, *self._v, self.swa_map)

    def layer_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        which, k = self._where[layer]
        return self._k[which][k], self._v[which][k]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k/v [T, num_kv_heads, head_dim] at the (full) `slots` [T] (int64) of `layer`."""
        if layer in self.sliding:
            slots = self.sliding_slots(slots)
        k_all, v_all = self.layer_kv(layer)
        k_all.index_copy_(0, slots, k.to(self.dtype))
        v_all.index_copy_(0, slots, v.to(self.dtype))

    def read_slots(self, full_slots: np.ndarray, swa_slots: np.ndarray) -> list[Tensor]:
        """Copies of the K/V at these slots, for a host store: [k_full, v_full] of shape
        [full layers, len(full_slots), heads, dim], then (split pools) [k_swa, v_swa] at the
        sliding pool's `swa_slots` (physical sliding slots, not full ones)."""
        out = []
        for which, slots in enumerate((full_slots, swa_slots)[: len(self._k)]):
            idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device)
            for t in (self._k[which], self._v[which]):
                if t.device.type == "cpu":
                    # One copy, already the host's (indexing copies faster than
                    # index_select here, which is half the pause of a demotion).
                    out.append(t[:, idx])
                    continue
                # In chunks: the device holds one chunk's copy at a time, never the entry's.
                host = torch.empty((t.shape[0], idx.numel(), *t.shape[2:]), dtype=t.dtype)
                for i in range(0, idx.numel(), COPY_CHUNK):
                    host[:, i : i + COPY_CHUNK].copy_(t.index_select(1, idx[i : i + COPY_CHUNK]))
                out.append(host)
        return out

    def write_slots(
        self, parts: Sequence[Tensor], full_slots: np.ndarray, swa_slots: np.ndarray
    ) -> None:
        """The inverse of `read_slots`: `parts` ([k_full, v_full(, k_swa, v_swa)], on the host,
        one entry per slot given) written at `full_slots` and the sliding `swa_slots`."""
        for which, slots in enumerate((full_slots, swa_slots)[: len(self._k)]):
            idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.device)
            if idx.numel() == 0:
                continue
            pairs = list(zip((self._k[which], self._v[which]), parts[2 * which : 2 * which + 2]))
            for _, part in pairs:
                if part.shape[1] != idx.numel():
                    raise ValueError(f"{part.shape[1]} saved positions for {idx.numel()} slots")
            for t, part in pairs:
                for i in range(0, idx.numel(), COPY_CHUNK):
                    chunk = part[:, i : i + COPY_CHUNK].to(self.device, self.dtype)
                    t.index_copy_(1, idx[i : i + COPY_CHUNK], chunk)

    def paged(self, layer: int) -> tuple[Tensor, Tensor]:
        """K and V of `layer` viewed as [pages, page_size, num_kv_heads, head_dim]."""
        k_all, v_all = self.layer_kv(layer)
        shape = (k_all.shape[0] // self.page_size, self.page_size, self.num_kv_heads, self.head_dim)
        return k_all.view(shape), v_all.view(shape)


class ReqToTokenTable:
    """int32 [num_rows, row_capacity]: slot of each (row, position); 0 where unset."""

    def __init__(
        self, num_rows: int, row_capacity: int, device: torch.device | str = "cpu"
    ) -> None:
        self.num_rows = num_rows
        self.row_capacity = row_capacity
        self.device = torch.device(device)
        self.table = torch.zeros((num_rows, row_capacity), dtype=torch.int32, device=self.device)
        self.staging = HostStaging(self.device)

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
        on_device = isinstance(flat_slots, Tensor) and flat_slots.device.type != "cpu"
        if on_device:
            slots = flat_slots.reshape(-1)
        else:
            slots = np.asarray(flat_slots, dtype=np.int32).reshape(-1)
        if slots.shape[0] != total:
            raise ValueError(f"{slots.shape[0]} slots for runs of total length {total}")
        if total == 0:
            return
        if (starts_np < 0).any() or (starts_np + lengths_np > self.row_capacity).any():
            raise ValueError("slot delta runs past the row capacity")
        if (rows_np < 0).any() or (rows_np >= self.num_rows).any():
            raise ValueError("slot delta names a row outside the table")
        if self.device.type == "cuda":  # one kernel launch, checked above on the host
            from kernels.triton_ops.kv import apply_slot_deltas

            host = [rows_np, starts_np, lengths_np] + ([] if on_device else [slots])
            staged = self.staging.to_device(host)
            apply_slot_deltas(self.table, *staged[:3], slots if on_device else staged[3])
            return
        run_starts_flat = np.cumsum(lengths_np) - lengths_np
        row_idx = np.repeat(rows_np, lengths_np)
        col_shift = np.repeat(starts_np - run_starts_flat, lengths_np)
        col_idx = np.arange(total, dtype=np.int64) + col_shift
        values = slots if on_device else torch.from_numpy(slots)
        self.table[torch.from_numpy(row_idx), torch.from_numpy(col_idx)] = values.to(self.device)

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Zero whole rows (debug hygiene; stale entries past a row's length are never read)."""
        self.table[torch.as_tensor(list(rows), dtype=torch.int64)] = 0
