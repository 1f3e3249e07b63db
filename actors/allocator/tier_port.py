"""How the allocator moves KV bytes between the pool and the host tier: the `TierPort`.

The ledger decides and accounts; the port only copies. Each call is awaited inside the
ledger operation that needs it, at a moment the runner computes nothing on the pages named:
the scheduler is waiting for the allocator's reply (an admission or a decode allocation), or
the pages belong to an idle session slot that no step reads. A port call that fails raises;
the ledger then keeps the KV where it was or prefills, never serves wrong KV.

`RemoteTierPort` sends the calls to the model runner actor, which holds the bytes
(`kernels.kv_store.HostKvStore`); the unit tests' port copies a fake runner's arrays.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from actors.runtime import ActorRef
from transport.messages.control import Ack
from transport.messages.tiers import (
    KvDrop,
    KvLoad,
    KvPersist,
    KvRestore,
    KvRestored,
    KvSave,
    KvSaved,
    KvSpill,
    KvSpilled,
    KvStage,
    KvStaged,
    KvStoreContents,
    KvStoreQuery,
    PersistedSession,
)


class TierPort(Protocol):
    async def save(self, handle: int, full_slots: np.ndarray, swa_slots: np.ndarray) -> int:
        """Copy positions [0, len(full_slots)) (and the sliding KV at `swa_slots`) out of the
        pool under `handle`; the bytes stored."""
        ...

    async def load(
        self,
        handle: int,
        start: int,
        full_slots: np.ndarray,
        swa_index: np.ndarray,
        swa_slots: np.ndarray,
    ) -> None:
        """Write saved positions [start, start + len(full_slots)) back at these slots."""
        ...

    async def spill(self, handle: int) -> int:
        """Move the entry from host memory to the disk tier; the bytes it takes there."""
        ...

    async def stage(self, handle: int) -> bool:
        """Have a spilled entry read ahead (beside the steps) for its coming load; whether
        it was. Changes no ownership: the entry stays on the disk tier."""
        ...

    async def drop(self, handles: list[int]) -> None: ...

    async def contents(self) -> dict[int, tuple[str, int]]:
        """Handle -> (tier, bytes) the store holds (the per-tier audit)."""
        ...


class RemoteTierPort:
    """A TierPort over the model runner actor; also the drain's manifest and the start's
    restore (`persist`, `restore`), which wait up to `persist_timeout_s` (a runner still
    loading its weights at start)."""

    def __init__(
        self, runner: ActorRef, copy_timeout_s: float = 60.0, persist_timeout_s: float = 300.0
    ) -> None:
        self.runner = runner
        # A copy waits behind at most the runner's current step; a runner that died meanwhile
        # must not hold the allocator (and so every step) for the default call timeout.
        self.copy_timeout_s = copy_timeout_s
        self.persist_timeout_s = persist_timeout_s

    async def save(self, handle: int, full_slots: np.ndarray, swa_slots: np.ndarray) -> int:
        reply = await self.runner.call(
            KvSave(handle=handle, full_slots=_ints(full_slots), swa_slots=_ints(swa_slots)),
            expect=KvSaved,
            timeout=self.copy_timeout_s,
        )
        return reply.nbytes

    async def load(
        self,
        handle: int,
        start: int,
        full_slots: np.ndarray,
        swa_index: np.ndarray,
        swa_slots: np.ndarray,
    ) -> None:
        await self.runner.call(
            KvLoad(
                handle=handle,
                start=start,
                full_slots=_ints(full_slots),
                swa_index=_ints(swa_index),
                swa_slots=_ints(swa_slots),
            ),
            expect=Ack,
            timeout=self.copy_timeout_s,
        )

    async def spill(self, handle: int) -> int:
        reply = await self.runner.call(
            KvSpill(handle=handle), expect=KvSpilled, timeout=self.copy_timeout_s
        )
        return reply.nbytes

    async def stage(self, handle: int) -> bool:
        reply = await self.runner.call(
            KvStage(handle=handle), expect=KvStaged, timeout=self.copy_timeout_s
        )
        return reply.staged

    async def drop(self, handles: list[int]) -> None:
        """Fire and forget: a drop the runner misses leaves bytes the idle audit frees."""
        await self.runner.send(KvDrop(handles=list(handles)))

    async def persist(self, sessions: list[PersistedSession]) -> None:
        await self.runner.call(
            KvPersist(sessions=sessions), expect=Ack, timeout=self.persist_timeout_s
        )

    async def restore(self) -> list[PersistedSession]:
        reply = await self.runner.call(
            KvRestore(), expect=KvRestored, timeout=self.persist_timeout_s
        )
        return list(reply.sessions)

    async def contents(self) -> dict[int, tuple[str, int]]:
        reply = await self.runner.call(
            KvStoreQuery(), expect=KvStoreContents, timeout=self.copy_timeout_s
        )
        return {h: (t, n) for h, t, n in zip(reply.handles, reply.tiers, reply.nbytes)}


def _ints(a: np.ndarray) -> list[int]:
    return np.asarray(a, dtype=np.int64).tolist()
