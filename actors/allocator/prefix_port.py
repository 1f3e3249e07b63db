"""How the allocator reaches the prefix tree: the `PrefixPort` protocol.

The allocator never touches the tree's state; it asks. Every operation that
moves pages between the tree and the allocator is one awaited call, so from
the allocator's mailbox each transfer is atomic. `LocalPrefixPort` serves a
`kvcore.RadixTree` directly (the unit tests' port); the allocator actor uses a
remote port that sends the same operations as messages to the radix actor,
which runs them on its tree.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvcore import MatchResult, RadixTree, TreeSnapshot
from kvcore.radix_tree import EvictedBlock, InsertResult


class PrefixPort(Protocol):
    async def match_and_lock(self, tokens: np.ndarray) -> MatchResult: ...

    async def insert(
        self,
        tokens: np.ndarray,
        slots: np.ndarray,
        unlock_node: int | None,
        lock_new: bool,
        alive: np.ndarray | None = None,
        need_alive_from: int | None = None,
    ) -> InsertResult:
        """`RadixTree.insert_and_relock`: the tree keeps its pages where it has them, heals
        dead ones with the caller's live ones, and stops where `need_alive_from` says."""
        ...

    async def unlock(self, node_id: int) -> None: ...

    async def pages_freed_by_unlocking(self, node_ids: list[int]) -> np.ndarray:
        """`RadixTree.pages_freed_by_unlocking`: what releasing those locks would make
        evictable; changes nothing."""
        ...

    async def evict(self, num_pages: int) -> np.ndarray: ...

    async def evict_blocks(self, num_pages: int) -> list[EvictedBlock]:
        """`evict`, with each evicted node's whole key (the caller frees its pages)."""
        ...

    async def owned_pages(self) -> np.ndarray: ...

    async def evictable_pages(self) -> int: ...

    async def sizes(self) -> tuple[int, int]:
        """(evictable tokens, protected tokens)."""
        ...

    async def snapshot(self) -> TreeSnapshot: ...


class LocalPrefixPort:
    """A PrefixPort over an in-process RadixTree."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree

    async def match_and_lock(self, tokens: np.ndarray) -> MatchResult:
        return self.tree.match_and_lock(tokens)

    async def insert(
        self,
        tokens: np.ndarray,
        slots: np.ndarray,
        unlock_node: int | None,
        lock_new: bool,
        alive: np.ndarray | None = None,
        need_alive_from: int | None = None,
    ) -> InsertResult:
        return self.tree.insert_and_relock(
            tokens, slots, unlock_node, lock_new, alive, need_alive_from
        )

    async def unlock(self, node_id: int) -> None:
        self.tree.dec_lock_ref(node_id)

    async def pages_freed_by_unlocking(self, node_ids: list[int]) -> np.ndarray:
        return self.tree.pages_freed_by_unlocking(node_ids)

    async def evict(self, num_pages: int) -> np.ndarray:
        return self.tree.evict(num_pages)

    async def evict_blocks(self, num_pages: int) -> list[EvictedBlock]:
        return self.tree.evict_blocks(num_pages)

    async def owned_pages(self) -> np.ndarray:
        return self.tree.owned_pages()

    async def evictable_pages(self) -> int:
        return self.tree.evictable_size // self.tree.page_size

    async def sizes(self) -> tuple[int, int]:
        return self.tree.evictable_size, self.tree.protected_size

    async def snapshot(self) -> TreeSnapshot:
        return self.tree.snapshot()


def run_sync(coro):
    """Run a ledger coroutine whose prefix port never suspends (`LocalPrefixPort`) to its
    result, without an event loop (tests and `bin/engine bench kv`)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("coroutine suspended; the ledger under test must not await real I/O")
