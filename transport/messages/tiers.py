"""Allocator <-> model runner: KV moved between the pool and the host tier.

The allocator decides and accounts (it owns every record and every tier handle); the runner
holds the bytes. Each move is one awaited call, made while the runner computes nothing for
the pages it names: a save reads an idle session's pages before the allocator frees them, a
load writes pages the allocator just reserved before the scheduler learns of them. Slots are
physical: full-pool slots, and the sliding pool's own slots where the pools are split. A
spill moves an entry from host memory to a file; a load reads either.
"""

from __future__ import annotations

from transport.messages.base import Message


class KvSave(Message):
    handle: int
    full_slots: list[int]  # positions [0, n) of the history, in order
    swa_slots: list[int] = []  # the sliding KV of the saved sliding positions, in order


class KvSaved(Message):
    handle: int
    nbytes: int


class KvLoad(Message):
    handle: int
    start: int  # the first saved position written
    full_slots: list[int]  # positions [start, start + len) go here
    swa_index: list[int] = []  # which saved sliding entries ...
    swa_slots: list[int] = []  # ... go to these sliding slots


class KvSpill(Message):
    """Host -> disk: write the entry to its file (checksummed) and free the host copy."""

    handle: int


class KvSpilled(Message):
    handle: int
    nbytes: int  # the file's size


class KvDrop(Message):
    handles: list[int]


class KvStoreQuery(Message):
    """The store's contents, for the ledger's per-tier audit."""


class KvStoreContents(Message):
    handles: list[int]
    nbytes: list[int]
    tiers: list[str] = []  # "host" or "disk", per handle
