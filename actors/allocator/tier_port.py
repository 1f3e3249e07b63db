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
    KvSave,
    KvSaved,
    KvSpill,
    KvSpilled,
    KvStoreContents,
    KvStoreQuery,
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

    async def drop(self, handles: list[int]) -> None: ...

    async def contents(self) -> dict[int, tuple[str, int]]:
        """Handle -> (tier, bytes) the store holds (the per-tier audit)."""
        ...


class RemoteTierPort:
    """A TierPort over the model runner actor."""

    def __init__(self, runner: ActorRef) -> None:
        self.runner = runner

    async def save(self, handle: int, full_slots: np.ndarray, swa_slots: np.ndarray) -> int:
        reply = await self.runner.call(
            KvSave(handle=handle, full_slots=_ints(full_slots), swa_slots=_ints(swa_slots)),
            expect=KvSaved,
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
        )

    async def spill(self, handle: int) -> int:
        reply = await self.runner.call(KvSpill(handle=handle), expect=KvSpilled)
        return reply.nbytes

    async def drop(self, handles: list[int]) -> None:
        await self.runner.call(KvDrop(handles=list(handles)), expect=Ack)

    async def contents(self) -> dict[int, tuple[str, int]]:
        reply = await self.runner.call(KvStoreQuery(), expect=KvStoreContents)
        return {h: (t, n) for h, t, n in zip(reply.handles, reply.tiers, reply.nbytes)}


def _ints(a: np.ndarray) -> list[int]:
    return np.asarray(a, dtype=np.int64).tolist()
