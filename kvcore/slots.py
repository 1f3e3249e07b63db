"""Slot / page arithmetic shared by the pool, the tree and the allocator.

A slot is one token position of KV storage: slot = page * page_size + offset.
Page 0 is reserved as padding (never handed out), so slot ids < page_size are
never owned by anybody.
"""

from __future__ import annotations

import numpy as np


def ceil_page(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def floor_page(n: int, page_size: int) -> int:
    return (n // page_size) * page_size


def slots_of_pages(pages: np.ndarray, page_size: int) -> np.ndarray:
    """All slots of `pages`, in page order: [p0*ps .. p0*ps+ps-1, p1*ps ...]."""
    pages = np.asarray(pages, dtype=np.int64)
    if page_size == 1:
        return pages.copy()
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)


def pages_of_slots(slots: np.ndarray, page_size: int) -> np.ndarray:
    """Distinct pages touched by `slots`, in first-seen order."""
    slots = np.asarray(slots, dtype=np.int64)
    if page_size == 1:
        return slots.copy()
    pages = slots // page_size
    if pages.size == 0:
        return pages
    # Slots of one request are page-contiguous, so consecutive duplicates suffice;
    # np.unique keeps it correct for arbitrary input too.
    _, first = np.unique(pages, return_index=True)
    return pages[np.sort(first)]
