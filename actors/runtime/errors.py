"""Errors of the actor runtime and the helpers that describe them."""

from __future__ import annotations

import traceback
from typing import Final

from transport.messages.control import ErrorReply

TRACEBACK_LIMIT_CHARS: Final = 8000


class HandledError(Exception):
    """An expected failure inside ``handle``: logged and counted, never crashes the actor."""


class RemoteError(Exception):
    """The callee answered a call with ``ErrorReply``."""

    def __init__(self, actor: str, reply: ErrorReply) -> None:
        super().__init__(f"{actor}: {reply.code}: {reply.message}")
        self.actor = actor
        self.reply = reply


class UnexpectedReply(Exception):
    """A call's reply was not of the type the caller asked for (``call(..., expect=...)``)."""


def format_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text[-TRACEBACK_LIMIT_CHARS:]


def describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def root_exception(exc: BaseException) -> BaseException:
    """The first leaf of nested exception groups (task groups wrap child failures)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
