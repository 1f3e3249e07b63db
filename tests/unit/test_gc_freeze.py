"""`actors/runtime/gc_freeze.py`: survivors frozen out of full collections, thawed back."""

from __future__ import annotations

import gc
import weakref

from actors.runtime.gc_freeze import freeze_survivors, thaw


class _Node:
    def __init__(self) -> None:
        self.other = self  # a reference cycle: only the collector frees it


def test_a_frozen_cycle_survives_collections_until_thawed():
    gc.collect()
    node = _Node()
    ref = weakref.ref(node)
    try:
        done = freeze_survivors()
        assert done is not None and done["frozen"] >= 1 and gc.get_freeze_count() >= 1
        del node
        gc.collect()
        assert ref() is not None  # frozen: the full collection skipped it
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_nothing_is_frozen_once_not_wanted():
    gc.collect()
    assert freeze_survivors(lambda: False) is None
    assert gc.get_freeze_count() == 0
