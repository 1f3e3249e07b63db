"""The end-to-end tier: the real model behind the real engine, a real `bin/engine serve`
process, the official `openai` client and the ZeroMQ SDK."""

from __future__ import annotations

import pytest

from tests.e2e.server_fixtures import start_server, stop_server


@pytest.fixture(scope="session")
def server():
    """One shared server process for every test that asks for it; stopped (and checked to
    exit cleanly) at the end of the session."""
    handle = start_server()
    try:
        yield handle
    finally:
        stop_server(handle)
