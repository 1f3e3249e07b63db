"""Process-wide settings every engine process gets before torch loads (actors/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import os, sys
import actors
assert "torch" not in sys.modules, "actors must not import torch"
print(os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"],
      os.environ.get("ONEDNN_MAX_CPU_ISA", "-"), os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "-"))
"""


def _probe(**env: str) -> str:
    ours = ("CACHE_CAPACITY", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE")
    clean = {k: v for k, v in os.environ.items() if not any(o in k for o in ours)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_onednn_primitive_caches_are_bounded_before_torch_loads():
    # Unbounded (1024 per-shape primitives), the runner's memory grew through a 30-minute
    # soak of mixed prompt lengths and batch sizes (bin/engine bench soak).
    assert _probe() == ["64", "64", "-", "-"]


def test_an_explicit_setting_wins():
    assert _probe(LRU_CACHE_CAPACITY="256") == ["256", "64", "-", "-"]


def test_torch_held_to_avx2_holds_onednn_and_fbgemm_to_it():
    """One variable for the whole engine: the libraries choosing their own instructions
    follow torch's (an explicit setting of theirs still wins)."""
    for level in ("avx2", "AVX2", "default"):
        assert _probe(ATEN_CPU_CAPABILITY=level)[2:] == ["AVX2", "AVX2"]
    assert _probe(ATEN_CPU_CAPABILITY="avx512")[2:] == ["-", "-"]
    assert _probe(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2_VNNI")[2:] == [
        "AVX2_VNNI",
        "AVX2",
    ]
