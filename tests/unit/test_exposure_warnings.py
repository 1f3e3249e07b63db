"""`serve` warns when it is reachable beyond this machine with no API key, and only then."""

from __future__ import annotations

import pytest

from actors.app.cli import exposure_warnings, is_loopback
from actors.app.config import EngineConfig


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("example.org", False),  # a name may resolve anywhere
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def _cfg(host: str, api_key: str = "") -> EngineConfig:
    return EngineConfig.load(overrides={"server.host": host, "server.api_key": api_key})


def test_loopback_without_a_key_is_quiet():
    assert exposure_warnings(_cfg("127.0.0.1"), "tcp://127.0.0.1:5555") == []
    assert exposure_warnings(_cfg("127.0.0.1"), "ipc:///tmp/kvactor.sock") == []
    assert exposure_warnings(_cfg("127.0.0.1"), None) == []


def test_public_binds_without_a_key_are_each_named():
    http_only = exposure_warnings(_cfg("0.0.0.0"), None)
    assert len(http_only) == 1 and "0.0.0.0" in http_only[0] and "--api-key" in http_only[0]
    both = exposure_warnings(_cfg("0.0.0.0"), "tcp://0.0.0.0:5555")
    assert len(both) == 2 and "tcp://0.0.0.0:5555" in both[1]
    zmq_only = exposure_warnings(_cfg("127.0.0.1"), "tcp://*:5555")
    assert len(zmq_only) == 1 and "ZeroMQ" in zmq_only[0]


def test_an_api_key_silences_every_warning():
    assert exposure_warnings(_cfg("0.0.0.0", api_key="k"), "tcp://0.0.0.0:5555") == []
