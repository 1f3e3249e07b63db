"""bin/engine from the outside: the launcher the README documents, as a user runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_engine(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVACTOR_LOG_LEVEL="warning")
    return subprocess.run(
        [str(ROOT / "bin" / "engine"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.model
def test_generate_streams_greedy_text():
    res = run_engine(
        "generate",
        "Count with me: 1, 2, 3, 4, 5,",
        "--max-tokens",
        "8",
        "--set",
        "kv.num_pages=128",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(" 6, 7"), res.stdout
    assert "8 tokens, finish=length" in res.stderr


def test_bad_arguments_fail_clearly():
    res = run_engine("generate", "x", "--set", "kv.no_such_key=1")
    assert res.returncode != 0
    assert "unknown config key kv.no_such_key" in res.stderr
    # A bad value or an unknown key stops `serve` at once (before any actor or the model).
    res = run_engine("serve", "--set", "kv.num_pages=abc", timeout=60)
    assert res.returncode != 0 and "kv.num_pages" in res.stderr, res.stderr[-2000:]
    assert "Expected `int`" in res.stderr
    res = run_engine("serve", "--set", "server.hots=0.0.0.0", timeout=60)
    assert res.returncode != 0 and "unknown config key server.hots" in res.stderr
    res = run_engine("frobnicate")
    assert res.returncode == 2 and "invalid choice" in res.stderr
