"""The page pool: the free list of KV pages.

Pages are numbered 1..num_pages (page 0 is the reserved padding page).
alloc/free are O(n) in the pages moved and O(1) amortised per page; every
page's state is tracked so a double free, or a free of a page the pool never
handed out, raises at once with the offending page ids.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PoolError(Exception):
    """A misuse of the page pool (a bookkeeping bug upstream, never user input)."""


class PageDoubleFree(PoolError):
    pass


class PageNotOwned(PoolError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Stack of free pages; the top is _free[_top-1]. Low ids pop first.
        self._free = np.arange(num_pages, 0, -1, dtype=np.int64)
        self._top = num_pages
        # _in_use[p] is True while page p is handed out. Index 0 (padding) stays False.
        self._in_use = np.zeros(num_pages + 1, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    @property
    def num_slots(self) -> int:
        """Slot ids span [0, num_slots) including the padding page."""
        return (self.num_pages + 1) * self.page_size

    def can_alloc(self, n: int) -> bool:
        return n <= self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """Hand out `n` pages, or None (and no change) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            return None
        pages = self._free[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._in_use[pages] = True
        return pages

    def free(self, pages: Iterable[int] | np.ndarray) -> None:
        """Return pages. Raises (changing nothing) on a double free or a foreign page."""
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size == 0:
            return
        bad = pages[(pages < 1) | (pages > self.num_pages)]
        if bad.size:
            raise PageNotOwned(f"pages {bad.tolist()} were never handed out by this pool")
        uniq, counts = np.unique(pages, return_counts=True)
        dup = uniq[counts > 1]
        if dup.size:
            raise PageDoubleFree(f"pages {dup.tolist()} freed twice in one call")
        not_in_use = pages[~self._in_use[pages]]
        if not_in_use.size:
            raise PageDoubleFree(f"pages {not_in_use.tolist()} are already free")
        self._in_use[pages] = False
        self._free[self._top : self._top + pages.size] = pages
        self._top += pages.size

    def is_free(self, page: int) -> bool:
        return 1 <= page <= self.num_pages and not self._in_use[page]

    def free_pages(self) -> np.ndarray:
        return self._free[: self._top].copy()

    def used_mask(self) -> np.ndarray:
        """A copy of the in-use flags, indexed by page id (index 0 is padding)."""
        return self._in_use.copy()
