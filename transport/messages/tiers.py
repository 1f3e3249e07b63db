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


class PersistedSession(Message):
    """One session as it survives a restart: the sessions actor's facts and the ledger's
    entry (its file holds the KV)."""

    session_id: str  # the engine's name of it (a frontend's HMAC of the client's id)
    ttl_s: float
    max_tokens: int
    turns: int
    tokens: int
    priority: int = 0
    retain_s: float = 0.0
    handle: int = 0
    tokens_keys: list[int] = []  # the prefix-cache keys of the stored positions
    alive: list[bool] = []  # per page: its sliding KV is stored ([] : one pool)
    nbytes: int = 0


class KvPersist(Message):
    """Allocator -> runner on drain: these spilled entries are to be found again after a
    restart (the manifest); every other file may go."""

    sessions: list[PersistedSession]


class KvRestore(Message):
    """Allocator -> runner at start: the sessions a previous run persisted whose files are
    there, for this model (the manifest is consumed)."""


class KvRestored(Message):
    sessions: list[PersistedSession]


class KvStoreQuery(Message):
    """The store's contents, for the ledger's per-tier audit."""


class KvStoreContents(Message):
    handles: list[int]
    nbytes: list[int]
    tiers: list[str] = []  # "host" or "disk", per handle


class KvStage(Message):
    """Allocator -> runner: read a spilled entry's file (and verify it) beside the steps,
    so that its load, when the admission comes, copies from memory. Changes no ownership:
    the file stays the entry; the read-ahead copy is the store's cache of it."""

    handle: int


class KvStaged(Message):
    handle: int
    staged: bool  # False: nothing to read (not spilled, gone) or the file failed its checks
