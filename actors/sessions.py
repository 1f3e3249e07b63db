"""The sessions actor: streaming sessions' lifetimes and turns.

A session keeps a conversation's KV across turns. The KV itself, like all KV, is owned by
the allocator (a session slot in `KvLedger`: after a turn finishes the slot takes the
request's whole record; the next turn restores it). This actor owns what is not KV: which
sessions exist, their idle timeout and token capacity, the one turn each may have in flight,
and the turns and tokens of the last good turn.

Turn protocol (the tokenizer drives it):
  BeginTurn (before submitting)  ->  one turn per session, else ERR_SESSION_BUSY (HTTP 409)
  EndTurn (after the request's final report; the scheduler has already settled its KV)
Close or idle timeout releases the slot (`CloseSlots` to the allocator); a close while a
turn runs takes effect when that turn ends. An offload (a client's hint between turns) has
the allocator move the slot's KV out of the pool now, to the host tier when there is one; a
prefetch brings it back from a tier into the pool before the next turn. A session opened
with a priority keeps its KV in the pool (and the tiers) ahead of lower ones; with retain_s,
its KV stays in the tiers that long after each turn unless nothing else is left to drop.
With a disk tier, a drain persists the idle sessions (their KV to files, their facts in the
runner's manifest) and the next start takes them back before answering about any session.

Session ids are never logged nor echoed in refusals: a log line holds `_tag(id)`, a short
hash that names a session across lines without letting anyone address it.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

import anyio

from actors.runtime import Actor
from transport.messages.alloc import (
    CloseSlots,
    CloseSlotsReply,
    OffloadSlot,
    OffloadSlotReply,
    OpenSlot,
    PersistSlots,
    PersistSlotsReply,
    PrefetchSlot,
    PrefetchSlotReply,
    RestoreSlots,
    RestoreSlotsReply,
    SlotStats,
    SlotStatsRequest,
)
from transport.messages.client import ERR_INVALID_REQUEST
from transport.messages.control import Ack, ErrorReply
from transport.messages.sessions import (
    ERR_SESSION_BUSY,
    ERR_SESSION_LIMIT,
    ERR_SESSION_NOT_FOUND,
    BeginTurn,
    BeginTurnReply,
    CloseSession,
    EndTurn,
    GetSession,
    OffloadSession,
    OpenSession,
    PersistSessions,
    PrefetchSession,
    SessionInfo,
    SessionsPersisted,
)
from transport.messages.tiers import PersistedSession

RESTORE_TIMEOUT_S = 300.0  # persisting or restoring many sessions' files, a runner loading
MAX_PRIORITY = 1000


@dataclass
class Session:
    id: str
    ttl_s: float
    max_tokens: int
    last_used: float  # time.monotonic() of open or of the last turn's end
    turns: int = 0
    tokens: int = 0  # prompt + output of the last good turn
    busy_rid: int | None = None  # the turn in flight
    close_pending: bool = False  # closed while a turn ran: release when it ends
    priority: int = 0  # the client's hints (`OpenSession`), kept by the allocator's slot
    retain_s: float = 0.0


class SessionsActor(Actor):
    inbox = (
        OpenSession
        | GetSession
        | CloseSession
        | OffloadSession
        | PrefetchSession
        | BeginTurn
        | EndTurn
        | PersistSessions
    )

    def __init__(
        self,
        context_len: int,
        max_sessions: int = 16,
        default_ttl_s: float = 300.0,
        max_ttl_s: float = 3600.0,
        reap_every_s: float = 1.0,
        allocator: str = "allocator",
    ) -> None:
        self.context_len = context_len
        self.max_sessions = max_sessions
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.reap_every_s = reap_every_s
        self.allocator_name = allocator
        self.sessions: dict[str, Session] = {}
        self.opened = 0
        self.timed_out = 0
        self._restored: anyio.Event | None = None  # set once a previous run's are taken back

    async def on_start(self) -> None:
        self.alloc = self.ref(self.allocator_name)
        self._restored = anyio.Event()
        self.spawn(self._restore)
        self.spawn(self._reaper)

    async def _restore(self) -> None:
        """Take back the sessions a previous run persisted on drain (their KV on disk, with
        a kv.store_dir): each idle, as it was, its idle timeout starting now."""
        try:
            reply = await self.alloc.call(
                RestoreSlots(), expect=RestoreSlotsReply, timeout=RESTORE_TIMEOUT_S
            )
            now = time.monotonic()
            for p in reply.sessions:
                if p.session_id not in self.sessions:
                    self.sessions[p.session_id] = Session(
                        id=p.session_id,
                        ttl_s=p.ttl_s,
                        max_tokens=p.max_tokens,
                        last_used=now,
                        turns=p.turns,
                        tokens=p.tokens,
                        priority=p.priority,
                        retain_s=p.retain_s,
                    )
            if reply.sessions:
                self.log.info("sessions restored", sessions=len(reply.sessions))
        finally:
            self._restored.set()

    async def _persist(self) -> SessionsPersisted:
        """Drain: the idle sessions' KV to disk, to be found by the next start."""
        idle = [s for s in self.sessions.values() if s.busy_rid is None and not s.close_pending]
        metas = [
            PersistedSession(
                session_id=s.id,
                ttl_s=s.ttl_s,
                max_tokens=s.max_tokens,
                turns=s.turns,
                tokens=s.tokens,
                priority=s.priority,
                retain_s=s.retain_s,
            )
            for s in idle
        ]
        reply = await self.alloc.call(
            PersistSlots(sessions=metas), expect=PersistSlotsReply, timeout=RESTORE_TIMEOUT_S
        )
        self.log.info("sessions persisted", sessions=reply.persisted, idle=len(idle))
        return SessionsPersisted(persisted=reply.persisted)

    async def handle(self, msg, sender):
        if self._restored is not None and not self._restored.is_set():
            # A previous run's sessions are being taken back: their ids answer once it ends.
            with anyio.move_on_after(RESTORE_TIMEOUT_S):
                await self._restored.wait()
        if isinstance(msg, PersistSessions):
            return await self._persist()
        if isinstance(msg, BeginTurn):
            return self._begin_turn(msg)
        if isinstance(msg, EndTurn):
            await self._end_turn(msg)
            return None
        if isinstance(msg, OpenSession):
            return await self._open(msg)
        s = self.sessions.get(msg.session_id)
        if s is None or s.close_pending:
            return ErrorReply(code=ERR_SESSION_NOT_FOUND, message=_NOT_FOUND)
        if isinstance(msg, GetSession):
            return await self._info(s)
        if isinstance(msg, OffloadSession | PrefetchSession):
            verb = "offload" if isinstance(msg, OffloadSession) else "prefetch"
            if s.busy_rid is not None:
                return ErrorReply(
                    code=ERR_SESSION_BUSY,
                    message=f"the session is running a turn; {verb} it when the turn ends",
                )
            if verb == "offload":
                off = await self.alloc.call(OffloadSlot(session_id=s.id), expect=OffloadSlotReply)
                self.log.info(
                    "session offloaded",
                    session=_tag(s.id),
                    pages=off.pages,
                    stored=off.stored_tokens,
                )
            else:
                got = await self.alloc.call(PrefetchSlot(session_id=s.id), expect=PrefetchSlotReply)
                self.log.info("session prefetched", session=_tag(s.id), pool=got.pool_tokens)
            return await self._info(s)
        if isinstance(msg, CloseSession):
            if s.busy_rid is not None:
                s.close_pending = True  # the running turn ends first
                return await self._info(s, closed=True)
            info = await self._info(s, closed=True)
            await self._release([s])
            return info
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def stats(self) -> dict[str, int | float]:
        return {
            "sessions_open": len(self.sessions),
            "sessions_opened": self.opened,
            "sessions_timed_out": self.timed_out,
        }

    # ---- lifetimes -----------------------------------------------------------------------
    async def _open(self, msg: OpenSession) -> SessionInfo | ErrorReply:
        ttl = msg.ttl_s or self.default_ttl_s
        if not 0 < ttl <= self.max_ttl_s:
            return _invalid(f"ttl_s must be in (0, {self.max_ttl_s:g}] (0: {self.default_ttl_s:g})")
        if not 0 <= msg.max_tokens <= self.context_len:
            return _invalid(f"max_tokens must be in [0, {self.context_len}] (0: the context)")
        if not -MAX_PRIORITY <= msg.priority <= MAX_PRIORITY:
            return _invalid(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
        if not 0 <= msg.retain_s <= ttl:
            return _invalid(f"retain_s must be in [0, ttl_s] (ttl_s is {ttl:g})")
        if len(self.sessions) >= self.max_sessions:
            return ErrorReply(
                code=ERR_SESSION_LIMIT,
                message=f"{len(self.sessions)} sessions are open (the most); close one first",
            )
        sid = msg.session_id or secrets.token_hex(12)
        if not 0 < len(sid) <= 128 or sid in self.sessions:
            return _invalid("session_id must be 1..128 characters and not in use")
        await self.alloc.call(
            OpenSlot(session_id=sid, priority=msg.priority, retain_s=msg.retain_s), expect=Ack
        )
        s = Session(
            id=sid,
            ttl_s=ttl,
            max_tokens=msg.max_tokens or self.context_len,
            last_used=time.monotonic(),
            priority=msg.priority,
            retain_s=msg.retain_s,
        )
        self.sessions[sid] = s
        self.opened += 1
        self.log.info("session opened", session=_tag(sid), ttl_s=ttl, max_tokens=s.max_tokens)
        return SessionInfo(
            session_id=sid,
            ttl_s=ttl,
            max_tokens=s.max_tokens,
            turns=0,
            tokens=0,
            held_tokens=0,
            idle_s=0.0,
            busy=False,
            priority=s.priority,
            retain_s=s.retain_s,
        )

    async def _release(self, sessions: list[Session]) -> None:
        """Forget these sessions and have the allocator release their slots."""
        for s in sessions:
            self.sessions.pop(s.id, None)
        reply = await self.alloc.call(
            CloseSlots(session_ids=[s.id for s in sessions]), expect=CloseSlotsReply
        )
        self.log.info("sessions closed", sessions=[_tag(s.id) for s in sessions], pages=reply.pages)

    async def _reaper(self) -> None:
        while True:
            await anyio.sleep(self.reap_every_s)
            now = time.monotonic()
            idle = [
                s
                for s in self.sessions.values()
                if s.busy_rid is None and now - s.last_used > s.ttl_s
            ]
            if idle:
                self.timed_out += len(idle)
                await self._release(idle)

    # ---- turns ---------------------------------------------------------------------------
    def _begin_turn(self, msg: BeginTurn) -> BeginTurnReply:
        s = self.sessions.get(msg.session_id)
        if s is None or s.close_pending:
            return BeginTurnReply(ok=False, code=ERR_SESSION_NOT_FOUND, message=_NOT_FOUND)
        if s.busy_rid is not None:
            return BeginTurnReply(
                ok=False,
                code=ERR_SESSION_BUSY,
                message="the session is running a turn already; one turn at a time",
            )
        if msg.prompt_tokens >= s.max_tokens:
            return BeginTurnReply(
                ok=False,
                code=ERR_INVALID_REQUEST,
                message=(
                    f"the conversation is {msg.prompt_tokens} tokens; the session holds "
                    f"at most {s.max_tokens} (its max_tokens), output included"
                ),
            )
        s.busy_rid = msg.rid
        room = s.max_tokens - msg.prompt_tokens
        return BeginTurnReply(ok=True, max_new_tokens=min(msg.max_new_tokens, room))

    async def _end_turn(self, msg: EndTurn) -> None:
        s = self.sessions.get(msg.session_id)
        if s is None or s.busy_rid != msg.rid:
            return  # a stale end (the session timed out or was closed meanwhile)
        s.busy_rid = None
        s.last_used = time.monotonic()
        if msg.ok:
            s.turns += 1
            s.tokens = msg.total_tokens
        if s.close_pending:
            await self._release([s])

    async def _info(self, s: Session, closed: bool = False) -> SessionInfo:
        held = await self.alloc.call(SlotStatsRequest(session_id=s.id), expect=SlotStats)
        return SessionInfo(
            session_id=s.id,
            ttl_s=s.ttl_s,
            max_tokens=s.max_tokens,
            turns=s.turns,
            tokens=s.tokens,
            held_tokens=held.held_tokens,
            idle_s=0.0 if s.busy_rid is not None else time.monotonic() - s.last_used,
            busy=s.busy_rid is not None,
            closed=closed,
            pool_tokens=held.pool_tokens,
            priority=s.priority,
            retain_s=s.retain_s,
        )


def _invalid(message: str) -> ErrorReply:
    return ErrorReply(code=ERR_INVALID_REQUEST, message=message)


_NOT_FOUND = "no such session (it may have timed out or been closed)"


def _tag(session_id: str) -> str:
    """What logs show of a session id: 8 hex digits of its SHA-256 (not the id)."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]
