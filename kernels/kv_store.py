"""The host tier's storage: copies of KV taken out of the paged pool, by handle.

The allocator decides what moves and keeps the accounting (`kvcore.tiers`); this store only
holds the bytes. An entry is what `KVCache.read_slots` returns for one session's history:
the full-attention layers' K/V at positions [0, n) in position order, and (split pools) the
sliding layers' K/V at the positions whose sliding KV existed, in position order. A load
writes a range of those positions back at the slots the allocator just reserved.

The store never decides anything: an unknown handle is an error the caller turns into a
prefill (never into wrong KV), and every entry's size is reported so the ledger's byte
count can be audited against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.kv_cache import KVCache


class MissingKv(KeyError):
    """A load or an audit named a handle the store does not hold."""


@dataclass(frozen=True)
class StoredKv:
    parts: list[Tensor]  # [k_full, v_full(, k_swa, v_swa)], layers first, positions second
    nbytes: int

    @property
    def positions(self) -> int:
        return int(self.parts[0].shape[1])

    @property
    def swa_positions(self) -> int:
        return int(self.parts[2].shape[1]) if len(self.parts) > 2 else 0


class HostKvStore:
    """Handle -> `StoredKv`, in host memory. Not bounded here: the allocator's budget is."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.entries: dict[int, StoredKv] = {}

    def save(self, handle: int, full_slots: np.ndarray, swa_slots: np.ndarray) -> int:
        """Copy the KV at these slots (full positions [0, n) in order; the sliding pool's
        physical slots of the saved sliding positions) under `handle`; its size in bytes.
        Saving a handle again replaces it."""
        parts = self.cache.read_slots(full_slots, swa_slots)
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        self.entries[handle] = StoredKv(parts, nbytes)
        return nbytes

    def load(
        self,
        handle: int,
        start: int,
        full_slots: np.ndarray,
        swa_index: np.ndarray,
        swa_slots: np.ndarray,
    ) -> None:
        """Write saved positions [start, start + len(full_slots)) at `full_slots`, and the
        saved sliding entries `swa_index` (indices into the saved sliding positions) at the
        sliding pool's `swa_slots`."""
        entry = self.entries.get(handle)
        if entry is None:
            raise MissingKv(f"no stored KV under handle {handle}")
        end = start + len(full_slots)
        if start < 0 or end > entry.positions:
            raise ValueError(f"positions [{start}, {end}) outside the {entry.positions} saved")
        index = np.asarray(swa_index, dtype=np.int64)
        if len(index) != len(swa_slots):
            raise ValueError(f"{len(index)} sliding entries for {len(swa_slots)} slots")
        if index.size and (index.min() < 0 or index.max() >= entry.swa_positions):
            raise ValueError(f"sliding entries outside the {entry.swa_positions} saved")
        parts = [p[:, start:end] for p in entry.parts[:2]]
        if len(entry.parts) > 2:
            idx = torch.from_numpy(np.ascontiguousarray(index))
            parts += [p.index_select(1, idx) for p in entry.parts[2:]]
        self.cache.write_slots(parts, full_slots, swa_slots)

    def drop(self, handles: list[int]) -> int:
        """Forget these handles (unknown ones are ignored); the bytes freed."""
        return sum(e.nbytes for h in handles if (e := self.entries.pop(h, None)) is not None)

    def sizes(self) -> dict[int, int]:
        """Handle -> bytes, for the ledger's audit."""
        return {h: e.nbytes for h, e in self.entries.items()}
