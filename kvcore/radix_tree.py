"""The radix (prefix) tree: token pages -> KV slots, with lock refs and LRU eviction.

Keys and values are page-aligned: every node holds a whole number of pages of
tokens (key) and the slots where their KV lives (value, same length). Matching
and inserting floor their input to a page multiple, so splits land on page
boundaries and the tree always owns whole pages.

Lock refs: locking a node locks the path to the root. A node whose lock_ref
goes 0 -> 1 moves its tokens from `evictable_size` to `protected_size`. Only
unlocked leaves are evicted (least recently used first). The root is always
locked and holds no tokens.

Node ids are stable: a split inserts a new *upper* node and keeps the id of
the lower part, so an id handed to a request stays valid while it is locked
(locked nodes are never evicted).

Sliding-window state: every page of a node is *alive* (its sliding-layer KV exists) or
*dead* (a tombstone: the window freed its sliding KV; full layers still have it). Pages
enter the tree with the state the inserter gives; an insert whose own page for a dead tree
page is alive *heals* it (the tree takes the fresh page and hands the dead one back to be
freed) when no holder reads the old page (the node is unlocked). The allocator's checker
holds this state equal to the sliding page map.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from kvcore.prefix_digest import DIGEST_BLOCK, MAX_DIGEST_BLOCKS, extend_hashes
from kvcore.slots import floor_page, pages_of_slots

_EMPTY = np.zeros(0, dtype=np.int64)


class _Node:
    __slots__ = (
        "id",
        "key",
        "value",
        "alive",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "depth",
        "hashes",
        "dead",
    )

    def __init__(
        self,
        node_id: int,
        key: np.ndarray,
        value: np.ndarray,
        parent: _Node | None,
        alive: np.ndarray | None = None,
    ):
        self.id = node_id
        self.key = key
        self.value = value
        # per page of the node: its sliding-window KV exists (False: a tombstone)
        self.alive = alive if alive is not None else np.zeros(0, dtype=bool)
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.depth = 0  # tokens on the path above this node
        # `prefix_digest` hashes of the digest blocks that end inside this node's key, and
        # per hash whether its end is a *dead end*: the sliding window a query right after it
        # reads has a dead page, so no request resumes there (see `RadixTree.dead_ends`)
        self.hashes: list[int] = []
        self.dead: list[bool] = []


@dataclass(frozen=True, slots=True)
class MatchResult:
    length: int  # matched tokens, a page multiple
    slots: np.ndarray  # KV slots of the matched tokens
    node_id: int  # deepest matched node (the root's id 0 when nothing matched)


@dataclass(frozen=True, slots=True)
class InsertResult:
    existing_len: int  # tokens of the key that were already in the tree before this insert
    node_id: int  # node ending at `length`
    slots: np.ndarray  # the tree's slots for the key's first `length` tokens (after healing)
    length: int = -1  # tokens inserted (the key's page-floored end unless cut); set always
    # Slots of dead pages the insert healed (replaced by the caller's live ones): no holder
    # reads them any more; the caller frees their pages.
    released: np.ndarray = field(default_factory=lambda: _EMPTY.copy())


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """One evicted node: the KV of positions [start, len(key)) was at `slots`; `key` is the
    whole path's tokens from the root (what the KV depends on), `alive` per page."""

    start: int
    key: np.ndarray
    slots: np.ndarray
    alive: np.ndarray


@dataclass(frozen=True, slots=True)
class TreeSnapshot:
    """The tree's structure as plain arrays, for the invariant checker.

    Node i (in these lists) has id `ids[i]`, parent id `parents[i]` (the root, id 0, is not
    listed), its own tokens `keys[i]` and their slots `values[i]`, and `lock_refs[i]`.
    """

    page_size: int
    ids: list[int]
    parents: list[int]
    keys: list[np.ndarray]
    values: list[np.ndarray]
    lock_refs: list[int]
    evictable_size: int
    protected_size: int
    alive: list[np.ndarray] = field(default_factory=list)  # per node, per page

    def path_slots(self, node_id: int) -> np.ndarray:
        """Slots of every token from the root down to `node_id` (empty for the root)."""
        index = {nid: i for i, nid in enumerate(self.ids)}
        parts = []
        while node_id != RadixTree.ROOT_ID:
            i = index[node_id]
            parts.append(self.values[i])
            node_id = self.parents[i]
        return np.concatenate(parts[::-1]) if parts else _EMPTY.copy()


class RadixTree:
    ROOT_ID = 0

    def __init__(self, page_size: int, digest_block: int = DIGEST_BLOCK, window: int = 0) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.page_size = page_size
        self.digest_block = digest_block
        # The sliding window whose KV the pages' alive state tracks (0: none, no dead ends).
        self.window = window
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._root = _Node(self.ROOT_ID, _EMPTY, _EMPTY, None)
        self._root.lock_ref = 1
        self._nodes: dict[int, _Node] = {self.ROOT_ID: self._root}
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self.version = 0  # goes up whenever the set of cached prefixes changes
        # Every node's `hashes`, counted (kept as nodes come and go: a digest is a copy),
        # and those of them that are dead ends.
        self._digest: dict[int, int] = {}
        self._dead: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @property
    def num_nodes(self) -> int:
        return len(self._nodes) - 1

    def has_node(self, node_id: int) -> bool:
        return node_id in self._nodes

    def lock_ref(self, node_id: int) -> int:
        return self._nodes[node_id].lock_ref

    def owned_slots(self) -> np.ndarray:
        values = [n.value for n in self._nodes.values() if n.value.size]
        return np.concatenate(values) if values else _EMPTY.copy()

    def owned_pages(self) -> np.ndarray:
        return pages_of_slots(self.owned_slots(), self.page_size)

    def snapshot(self) -> TreeSnapshot:
        nodes = [n for n in self._nodes.values() if n is not self._root]
        return TreeSnapshot(
            page_size=self.page_size,
            ids=[n.id for n in nodes],
            parents=[n.parent.id for n in nodes],
            keys=[n.key.copy() for n in nodes],
            values=[n.value.copy() for n in nodes],
            lock_refs=[n.lock_ref for n in nodes],
            evictable_size=self.evictable_size,
            protected_size=self.protected_size,
            alive=[n.alive.copy() for n in nodes],
        )

    def digest(self, limit: int = MAX_DIGEST_BLOCKS) -> tuple[list[int], bool]:
        """(hashes, truncated): the `prefix_digest` hash of every whole `digest_block`-token
        unsalted prefix the tree holds (salted ones stay private to their namespace); at
        most `limit` of them, then parents before children, so the list stays closed
        under prefixes."""
        if len(self._digest) <= limit:
            return list(self._digest), False
        out: list[int] = []
        stack = list(self._root.children.values())
        while stack and len(out) < limit:
            node = stack.pop()
            out += node.hashes
            stack += node.children.values()
        return out[:limit], True

    def dead_ends(self) -> list[int]:
        """The digest's hashes whose prefix no request can resume from: a query right after
        its end reads the sliding window [end - window + 1, end), and a page of that window
        is dead (the ledger's `_swa_usable` rule). A request whose prompt matches such a
        prefix reuses only up to the last end before it that is not dead (or nothing)."""
        return list(self._dead)

    def locked_node_ids(self) -> list[int]:
        return [i for i, n in self._nodes.items() if n.lock_ref > 0 and i != self.ROOT_ID]

    # ---- match / insert ------------------------------------------------------------------
    def match_prefix(self, tokens) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`. Refreshes LRU; may split a node."""
        key = np.asarray(tokens, dtype=np.int64)
        end = floor_page(len(key), self.page_size)
        node, pos, parts = self._root, 0, []
        now = next(self._clock)
        while pos < end:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._common_len(child.key, key[pos:end])
            if m == 0:
                break
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            parts.append(child.value)
            pos += m
            node = child
        slots = np.concatenate(parts) if parts else _EMPTY.copy()
        return MatchResult(pos, slots, node.id)

    def insert(self, tokens, slots, alive=None, need_alive_from: int | None = None) -> InsertResult:
        """Insert the page-floored prefix of `tokens` with their `slots`; `alive` says per
        page whether the caller's sliding KV exists (None: every page's does).

        Where the tree already holds a prefix it keeps its own slots: the caller's slots
        there that differ are duplicates the caller frees (except the ones it had matched
        from the tree in the first place). One exception heals the tree: a dead tree page
        whose caller page is alive, in a node nobody locks, takes the caller's page, and
        the dead one comes back in `released`.

        `need_alive_from`: the caller will read sliding KV from this position on (its next
        queries' window), so the insert stops (`length` < the key's end) at the first tree
        page from there that the caller would take from the tree dead and cannot heal.
        """
        key = np.asarray(tokens, dtype=np.int64)
        val = np.asarray(slots, dtype=np.int64)
        if len(val) < len(key):
            raise ValueError(f"{len(key)} tokens but only {len(val)} slots")
        ps = self.page_size
        end = floor_page(len(key), ps)
        alive_in = (
            np.ones(end // ps, dtype=bool)
            if alive is None
            else np.asarray(alive, dtype=bool)[: end // ps]
        )
        if alive_in.size < end // ps:
            raise ValueError(f"{alive_in.size} page states for {end // ps} pages")
        node, pos, parts, released = self._root, 0, [], []
        now = next(self._clock)
        existing = None
        while pos < end:
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            m = 0 if child is None else self._common_len(child.key, key[pos:end])
            if m == 0:
                existing = pos
                leaf = _Node(
                    next(self._ids),
                    key[pos:end].copy(),
                    val[pos:end].copy(),
                    node,
                    alive_in[pos // ps : end // ps].copy(),
                )
                leaf.last_access = now
                leaf.depth = pos
                self._hash_blocks(leaf, node, key)
                node.children[ck] = leaf
                self._nodes[leaf.id] = leaf
                self.evictable_size += end - pos
                self.version += 1
                parts.append(leaf.value)
                node, pos = leaf, end
                break
            if m < len(child.key):
                child = self._split(child, m)
            stop = self._first_unhealable(child, pos, val, alive_in, need_alive_from)
            if stop is not None:
                if stop == 0:
                    end = pos
                    break
                child = self._split(child, stop * ps)
                end = pos + stop * ps
            released += self._heal(child, pos, val, alive_in)
            child.last_access = now
            parts.append(child.value)
            pos += len(child.key)
            node = child
        tree_slots = np.concatenate(parts) if parts else _EMPTY.copy()
        return InsertResult(
            end if existing is None else existing,
            node.id,
            tree_slots,
            pos,
            np.concatenate(released) if released else _EMPTY.copy(),
        )

    def _first_unhealable(self, node: _Node, pos: int, val, alive_in, need_alive_from):
        """Index of the node's first page the caller must not take (dead, its own differs
        and cannot heal it, inside the window it will read), or None."""
        if need_alive_from is None or node.alive.all():
            return None
        ps = self.page_size
        for k in np.flatnonzero(~node.alive).tolist():
            p = pos + k * ps
            if p < need_alive_from or node.value[k * ps] == val[p]:
                continue
            if not (alive_in[p // ps] and node.lock_ref == 0):
                return k
        return None

    def _heal(self, node: _Node, pos: int, val, alive_in) -> list[np.ndarray]:
        """Give the node's dead pages the caller's live ones where nobody locks it; the
        displaced slots."""
        if node.alive.all() or node.lock_ref:
            return []
        ps = self.page_size
        out = []
        for k in np.flatnonzero(~node.alive).tolist():
            p = pos + k * ps
            if alive_in[p // ps] and node.value[k * ps] != val[p]:
                out.append(node.value[k * ps : (k + 1) * ps].copy())
                node.value[k * ps : (k + 1) * ps] = val[p : p + ps]
                node.alive[k] = True
        if out:
            self._refresh_dead_below(node)
        return out

    # ---- the allocator's two compound operations ------------------------------------------
    def match_and_lock(self, tokens) -> MatchResult:
        """`match_prefix`, then lock the matched node (when anything matched)."""
        result = self.match_prefix(tokens)
        if result.length:
            self.inc_lock_ref(result.node_id)
        return result

    def insert_and_relock(
        self,
        tokens,
        slots,
        unlock_node: int | None,
        lock_new: bool,
        alive=None,
        need_alive_from: int | None = None,
    ) -> InsertResult:
        """`insert`, then move a request's lock from `unlock_node` to the inserted path.

        The new path is locked before the old one is unlocked, so no node they share is
        evictable in between.
        """
        result = self.insert(tokens, slots, alive, need_alive_from)
        if lock_new and result.node_id != self.ROOT_ID:
            self.inc_lock_ref(result.node_id)
        if unlock_node is not None:
            self.dec_lock_ref(unlock_node)
        return result

    # ---- locks ---------------------------------------------------------------------------
    def inc_lock_ref(self, node_id: int) -> None:
        node = self._nodes[node_id]
        while node is not self._root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node_id: int) -> None:
        node = self._nodes[node_id]
        path = []
        while node is not self._root:
            if node.lock_ref <= 0:
                raise ValueError(f"node {node_id}: unlock without a lock (at node {node.id})")
            path.append(node)
            node = node.parent
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.protected_size -= len(n.key)
                self.evictable_size += len(n.key)

    def pages_freed_by_unlocking(self, node_ids) -> np.ndarray:
        """The pages that would become evictable if one lock on each of `node_ids` (a node
        may appear more than once) were released: those of every node all of whose locks
        are among them. Changes nothing."""
        drops: dict[int, int] = {}
        for node_id in node_ids:
            node = self._nodes[node_id]
            while node is not self._root:
                drops[node.id] = drops.get(node.id, 0) + 1
                node = node.parent
        freed = [
            self._nodes[i].value
            for i, n in drops.items()
            if self._nodes[i].lock_ref == n and self._nodes[i].value.size
        ]
        slots = np.concatenate(freed) if freed else _EMPTY
        return pages_of_slots(slots, self.page_size)

    # ---- eviction ------------------------------------------------------------------------
    def evict(self, num_pages: int) -> np.ndarray:
        """Evict unlocked leaves, LRU first, until >= num_pages pages are freed (or none left).

        Returns the freed pages; the caller returns them to the page pool.
        """
        freed = [n.value for n in self._evict_nodes(num_pages)]
        slots = np.concatenate(freed) if freed else _EMPTY
        return pages_of_slots(slots, self.page_size)

    def evict_blocks(self, num_pages: int) -> list[EvictedBlock]:
        """`evict`, returning each evicted node with the tokens its KV depends on (a tier
        below the pool may keep a copy); its pages are the caller's to free."""
        return [
            EvictedBlock(start, key, node.value, node.alive)
            for node, start, key in self._evict_nodes(num_pages, with_keys=True)
        ]

    def _evict_nodes(self, num_pages: int, with_keys: bool = False) -> list:
        """Unlink unlocked leaves, LRU first, until >= num_pages pages' worth; the nodes
        (with their start position and whole path key when `with_keys`)."""
        want = num_pages * self.page_size
        heap = [(n.last_access, n.id) for n in self._nodes.values() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        out: list = []
        got = 0
        while got < want and heap:
            _, nid = heapq.heappop(heap)
            node = self._nodes[nid]
            parent = node.parent
            if with_keys:
                path = self._path_key(node)
                out.append((node, len(path) - len(node.key), path))
            else:
                out.append(node)
            del parent.children[self._child_key(node.key, 0)]
            del self._nodes[nid]
            for h in node.hashes:
                _uncount(self._digest, h)
            for h, dead in zip(node.hashes, node.dead, strict=True):
                if dead:
                    _uncount(self._dead, h)
            self.evictable_size -= len(node.key)
            got += len(node.key)
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id))
        self.version += bool(out)
        return out

    def _path_key(self, node: _Node) -> np.ndarray:
        parts = []
        while node is not self._root:
            parts.append(node.key)
            node = node.parent
        return np.concatenate(parts[::-1])

    # ---- internals -----------------------------------------------------------------------
    def _hash_blocks(self, leaf: _Node, parent: _Node, key: np.ndarray) -> None:
        """Hash the digest blocks that end inside a new leaf (`key`: the whole path's)."""
        if not len(leaf.key) or int(leaf.key[0]) >> 32:
            return  # a salted namespace (kvcore.salt) is not listed
        block = self.digest_block
        start = leaf.depth // block * block
        prev, node = 0, parent
        while node is not self._root and not node.hashes:
            node = node.parent
        if node is not self._root:
            prev = node.hashes[-1]
        leaf.hashes = extend_hashes(prev, key[start : leaf.depth + len(leaf.key)], block)
        for h in leaf.hashes:
            self._digest[h] = self._digest.get(h, 0) + 1
        leaf.dead = [False] * len(leaf.hashes)
        self._set_dead(leaf)

    def _dead_flags(self, node: _Node) -> list[bool]:
        """Per hash of `node`: its block's end is a dead end (`dead_ends`)."""
        if not self.window or not node.hashes:
            return [False] * len(node.hashes)
        ps, block, window = self.page_size, self.digest_block, self.window
        first_end = (node.depth // block + 1) * block
        lo = max(first_end - window + 1, 0) // ps * ps  # the first position any end reads
        parts, top = [], node
        while True:  # the pages' alive state from `lo` to the node's end, along its path
            parts.append(top.alive)
            if top.depth <= lo or top.parent is self._root:
                break
            top = top.parent
        if all(a.all() for a in parts):
            return [False] * len(node.hashes)
        alive = np.concatenate(parts[::-1])
        base = top.depth // ps
        return [
            not alive[max(e - window + 1, 0) // ps - base : -(-e // ps) - base].all()
            for e in range(first_end, first_end + len(node.hashes) * block, block)
        ]

    def _set_dead(self, node: _Node) -> bool:
        """Recompute `node.dead` (and the counted set); whether any flag changed."""
        flags = self._dead_flags(node)
        if flags == node.dead:
            return False
        for h, was, now in zip(node.hashes, node.dead, flags, strict=True):
            if was and not now:
                _uncount(self._dead, h)
            elif now and not was:
                self._dead[h] = self._dead.get(h, 0) + 1
        node.dead = flags
        return True

    def _refresh_dead_below(self, node: _Node) -> None:
        """After `node`'s pages came alive: its ends and those below it whose window can
        reach its pages (a node starting a window or more past its end cannot)."""
        if not self.window:
            return
        reach = node.depth + len(node.key) + self.window
        changed, stack = False, [node]
        while stack:
            n = stack.pop()
            changed |= self._set_dead(n)
            stack += [c for c in n.children.values() if c.depth < reach]
        self.version += changed

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return node is not self._root and not node.children and node.lock_ref == 0

    def _child_key(self, key: np.ndarray, pos: int) -> object:
        if self.page_size == 1:
            return int(key[pos])
        return key[pos : pos + self.page_size].tobytes()

    def _common_len(self, a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        neq = np.nonzero(a[:n] != b[:n])[0]
        m = int(neq[0]) if neq.size else n
        return floor_page(m, self.page_size)

    def _split(self, child: _Node, m: int) -> _Node:
        """Cut `child` at m tokens: a new upper node takes [0, m); `child` keeps the rest."""
        parent = child.parent
        k = m // self.page_size
        upper = _Node(
            next(self._ids),
            child.key[:m].copy(),
            child.value[:m].copy(),
            parent,
            child.alive[:k].copy(),
        )
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.depth = child.depth
        ends = (child.depth + m) // self.digest_block - child.depth // self.digest_block
        upper.hashes, child.hashes = child.hashes[:ends], child.hashes[ends:]
        upper.dead, child.dead = child.dead[:ends], child.dead[ends:]
        child.depth += m
        child.key = child.key[m:].copy()
        child.value = child.value[m:].copy()
        child.alive = child.alive[k:].copy()
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        self._nodes[upper.id] = upper
        return upper


def _uncount(counts: dict[int, int], key: int) -> None:
    left = counts.pop(key) - 1
    if left:
        counts[key] = left
