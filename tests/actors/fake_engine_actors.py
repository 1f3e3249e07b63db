"""Stand-ins for the model runner and tokenizer, for scheduler tests without a model.

`FakeRunner` is a real actor behind a real socket that plays the model: it keeps a
replica of the req-to-token table from the slot deltas, "writes KV" by recording
(token, position) per slot, and checks on every forward that each request's row
points at slots holding exactly that request's tokens at those positions (prefix
hits included), never into the padding page and always at in-page offset
position % page_size (the paged-attention layout). `hold_at_step` pauses one forward
until the test releases it, so a test can act while exactly that step is in flight.
Its next token is a deterministic function of the request's tokens, so outputs are
reproducible across batchings, retractions and evictions.
`SinkTokenizer` collects the scheduler's TokenBatch messages.
"""

from __future__ import annotations

import anyio
import numpy as np

from actors.runtime import Actor
from transport.messages.control import Ack
from transport.messages.engine import TokenBatch
from transport.messages.runner import ForwardBatchMsg, StepResultMsg
from transport.messages.tiers import (
    KvDrop,
    KvLoad,
    KvSave,
    KvSaved,
    KvStoreContents,
    KvStoreQuery,
)


def next_token(tokens: list[int]) -> int:
    h = 7
    for t in tokens[-4:]:
        h = (h * 131 + t) % 1_000_003
    return 100 + (h + len(tokens)) % 900


class FakeRunner(Actor):
    """Checks every forward's rows against the tokens it wrote; keeps a host tier's store of
    (token, position) per saved slot, as the real runner keeps K/V (one pool)."""

    inbox = ForwardBatchMsg | KvSave | KvLoad | KvDrop | KvStoreQuery

    def __init__(self, num_slots: int, max_rows: int, row_capacity: int, page_size: int = 1):
        self.page_size = page_size
        self.table = np.zeros((max_rows + 1, row_capacity), dtype=np.int64)
        self.slot_token = np.full(num_slots, -1, dtype=np.int64)
        self.slot_pos = np.full(num_slots, -1, dtype=np.int64)
        self.prompts: dict[int, list[int]] = {}  # set by the test before submitting
        self.generated: dict[int, list[int]] = {}
        self.batches: list[ForwardBatchMsg] = []
        self.hold_at_step: int | None = None  # pause the forward of this step number
        self.held = anyio.Event()  # set while that forward is paused
        self.release = anyio.Event()  # set by the test to let it finish
        self.crash_at_step: int | None = None  # crash the actor during this step's forward
        self.starts = 0
        self.store: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # handle -> tokens, positions
        self.loads = 0

    async def on_start(self) -> None:
        self.starts += 1

    async def _crash(self) -> None:
        raise RuntimeError("injected runner crash")

    async def handle(self, msg, sender):
        if not isinstance(msg, ForwardBatchMsg):
            return self._tier(msg)
        self.batches.append(msg)
        if self.crash_at_step is not None and msg.step == self.crash_at_step:
            self.crash_at_step = None
            self.spawn(self._crash)  # a failing background task crashes the actor
            await anyio.sleep_forever()  # this step never answers
        if self.hold_at_step is not None and msg.step == self.hold_at_step:
            self.held.set()
            await self.release.wait()
        d = msg.deltas
        off = 0
        for row, start, n in zip(d.rows, d.starts, d.lengths):
            self.table[row, start : start + n] = d.slots[off : off + n]
            off += n
        rids, toks = [], []
        pos = 0
        for rid, row, prefix, n, need in zip(
            msg.rids, msg.rows, msg.prefix_lens, msg.extend_lens, msg.need_logits
        ):
            ids = list(msg.input_ids[pos : pos + n])
            pos += n
            expected = self.prompts[rid] + self.generated.setdefault(rid, [])
            assert ids == expected[prefix : prefix + n], f"rid {rid}: fed the wrong tokens"
            slots = self.table[row, prefix : prefix + n]
            ps = self.page_size
            assert (slots >= ps).all(), f"rid {rid}: slots {slots} in the padding page"
            offsets = np.arange(prefix, prefix + n) % ps
            assert (slots % ps == offsets).all(), f"rid {rid}: slots {slots} off their offsets"
            self.slot_token[slots] = ids
            self.slot_pos[slots] = np.arange(prefix, prefix + n)
            every = self.table[row, : prefix + n]
            assert (self.slot_pos[every] == np.arange(prefix + n)).all(), f"rid {rid}: positions"
            assert (self.slot_token[every] == expected[: prefix + n]).all(), (
                f"rid {rid}: foreign KV"
            )
            if need:
                tok = next_token(expected[: prefix + n])
                self.generated[rid].append(tok)
                rids.append(rid)
                toks.append(tok)
        return StepResultMsg(step=msg.step, rids=rids, tokens=toks)

    def _tier(self, msg):
        if isinstance(msg, KvSave):
            slots = np.asarray(msg.full_slots, dtype=np.int64)
            self.store[msg.handle] = (self.slot_token[slots].copy(), self.slot_pos[slots].copy())
            return KvSaved(handle=msg.handle, nbytes=16 * len(slots))
        if isinstance(msg, KvLoad):
            tokens, positions = self.store[msg.handle]
            slots = np.asarray(msg.full_slots, dtype=np.int64)
            end = msg.start + len(slots)
            self.slot_token[slots] = tokens[msg.start : end]
            self.slot_pos[slots] = positions[msg.start : end]
            self.loads += 1
            return Ack()
        if isinstance(msg, KvDrop):
            for h in msg.handles:
                self.store.pop(h, None)
            return Ack()
        return KvStoreContents(
            handles=list(self.store),
            nbytes=[16 * len(t) for t, _ in self.store.values()],
            tiers=["host"] * len(self.store),
        )


class SinkTokenizer(Actor):
    inbox = TokenBatch

    def __init__(self) -> None:
        self.outputs: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self.cached: dict[int, int] = {}
        self.batches = 0

    async def handle(self, msg: TokenBatch, sender):
        self.batches += 1
        pos = 0
        for rid, n, fin, cached in zip(msg.rids, msg.counts, msg.finish, msg.cached):
            self.outputs.setdefault(rid, []).extend(msg.tokens[pos : pos + n])
            pos += n
            if cached >= 0:
                self.cached[rid] = cached
            if fin:
                self.finish[rid] = fin
        return None
