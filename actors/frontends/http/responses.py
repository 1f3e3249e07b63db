"""Placeholder while the responses API is written (this commit's successor replaces it)."""

from __future__ import annotations

from actors.frontends.http.errors import ApiError


async def _not_yet(app, scope, receive, send) -> None:
    raise ApiError(501, "not implemented yet", code="not_implemented")


create = retrieve = delete = _not_yet
