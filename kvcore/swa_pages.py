"""The sliding-window layers' pages and the full-to-sliding page map.

Models like Gemma 3 have full-attention layers, which read every position, and sliding
layers, which read only the last `window` positions. Their KV lives in two page pools:
the full pool (`PagePool`, whose slots the req-to-token rows hold) and this one. Every
full page in use by a request or the prefix tree has a sliding page mapped to it
(`map[full_page]`, 0 = none), except pages whose sliding KV was freed because every
position on them fell out of every window that will read them. The model runner keeps a
replica of the map (sent as deltas) and sliding layers write and read KV at
`map[slot // page_size] * page_size + slot % page_size`.

Invariants (checked by `kvcore.invariants.check_swa`): every mapped sliding page is mapped
from exactly one full page; mapped + free == total sliding pages; a free full page maps to
nothing. Page 0 of both pools is the padding page and maps to page 0.
"""

from __future__ import annotations

import numpy as np

from kvcore.page_pool import PagePool


class SwaPages:
    def __init__(self, num_full_pages: int, num_swa_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_swa_pages, page_size)
        self.map = np.zeros(num_full_pages + 1, dtype=np.int64)  # full page -> sliding page

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def mapped(self, full_pages: np.ndarray) -> np.ndarray:
        """Bool per full page: it has a sliding page."""
        return self.map[np.asarray(full_pages, dtype=np.int64)] > 0

    def map_new(self, full_pages: np.ndarray) -> np.ndarray | None:
        """Give each of these (unmapped) full pages a sliding page; the sliding pages, or
        None (nothing changed) when the pool has too few."""
        full_pages = np.asarray(full_pages, dtype=np.int64)
        if full_pages.size == 0:
            return np.zeros(0, dtype=np.int64)
        if (self.map[full_pages] != 0).any():
            raise ValueError(f"full pages {full_pages[self.map[full_pages] != 0][:8]} mapped")
        swa = self.pool.alloc(int(full_pages.size))
        if swa is None:
            return None
        self.map[full_pages] = swa
        return swa

    def unmap(self, full_pages: np.ndarray) -> int:
        """Free the sliding pages of these full pages (unmapped ones are skipped); how many
        were freed."""
        full_pages = np.asarray(full_pages, dtype=np.int64)
        swa = self.map[full_pages]
        have = swa > 0
        if have.any():
            self.pool.free(swa[have])
            self.map[full_pages[have]] = 0
        return int(have.sum())

    def mapped_pages(self) -> np.ndarray:
        """The full pages that have a sliding page."""
        return np.flatnonzero(self.map > 0)
