"""The tiers' promise: the unit tier collects without torch, sockets' peers or the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/unit"])
heavy = sorted(m for m in ("torch", "transformers", "kernels.models") if m in sys.modules)
print("HEAVY:" + ",".join(heavy))
sys.exit(int(code))
"""


def test_unit_tier_collects_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "HEAVY:\n" in out.stdout, out.stdout[-2000:]
