"""Streaming sessions: frontends and the tokenizer <-> the sessions actor.

A session keeps a conversation's KV at the allocator between turns (see
`actors/sessions.py`); these messages open, inspect and close it, and bracket each turn.
Session ids here are the engine's names of sessions: the frontends derive them from the
client's id and its API key (`actors.frontends.base.engine_session_id`), so a client's id
never reaches the engine and a session is only found under the key that opened it.
"""

from __future__ import annotations

from transport.messages.base import Message

# The refusals a session operation or turn may get, the same codes on every frontend.
from transport.messages.client import (  # noqa: F401 (re-exported)
    ERR_SESSION_BUSY,
    ERR_SESSION_LIMIT,
    ERR_SESSION_NOT_FOUND,
)


class OpenSession(Message):
    ttl_s: float = 0.0  # idle seconds before the session closes itself; 0: the default
    max_tokens: int = 0  # conversation tokens the session may hold; 0: the context length
    session_id: str = ""  # its name (a frontend's engine_session_id); "": the actor picks one
    # Hints. A higher priority keeps its KV in the pool (and the tiers) longer; for
    # retain_s seconds after each turn (at most ttl_s) its KV is dropped from the tiers
    # only when nothing else is left to drop.
    priority: int = 0
    retain_s: float = 0.0


class SessionInfo(Message):
    session_id: str
    ttl_s: float
    max_tokens: int
    turns: int  # turns that finished well
    tokens: int  # conversation tokens (prompt + output) as of the last good turn
    held_tokens: int  # tokens whose KV the session holds now (0 after an abort wiped it)
    idle_s: float  # seconds since the last turn ended (or since open)
    busy: bool  # a turn is running
    closed: bool = False  # closed by this call (or, with busy, closes when the turn ends)
    pool_tokens: int = 0  # of held_tokens, those in the pool (the rest wait in a tier)
    priority: int = 0
    retain_s: float = 0.0


class GetSession(Message):
    session_id: str


class CloseSession(Message):
    session_id: str


class PersistSessions(Message):
    """The engine on drain: keep the idle sessions' KV on disk for the next start."""


class SessionsPersisted(Message):
    persisted: int


class PrefetchSession(Message):
    """Load an idle session's KV from its tier back into the pool now (its next turn is
    coming); the reply's held_tokens say what the pool holds."""

    session_id: str


class OffloadSession(Message):
    """Move an idle session's KV out of the pool now (to the host tier, if there is one);
    its next turn loads it back."""

    session_id: str


class BeginTurn(Message):
    """Tokenizer -> sessions before a session request is submitted: one turn at a time."""

    session_id: str
    rid: int
    prompt_tokens: int
    max_new_tokens: int


class BeginTurnReply(Message):
    ok: bool
    code: str = ""  # when refused: ERR_SESSION_* or "invalid_request"
    message: str = ""
    max_new_tokens: int = 0  # when ok: the turn's max_tokens, cut to the session's capacity


class EndTurn(Message):
    """Tokenizer -> sessions when the turn's request has ended (its KV already settled)."""

    session_id: str
    rid: int
    ok: bool  # finished well (stop, length): its KV was saved to the session
    total_tokens: int  # prompt + output tokens of the turn
