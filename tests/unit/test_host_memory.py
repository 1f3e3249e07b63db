"""kernels.host_memory: freed large blocks stay in the process (no page faults per reuse).

Each case runs in a fresh interpreter, so the allocator starts from glibc's defaults.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A 40 MiB block malloc'd, touched and freed 10 times on a worker thread (as the runner's
# forward does with its logits); prints the minor page faults per round over 4 KiB pages.
PROBE = """
import ctypes, ctypes.util, resource, sys, threading
if sys.argv[1] == "keep":
    from kernels.host_memory import keep_freed_memory
    applied, why = keep_freed_memory()
    assert applied, why
    assert keep_freed_memory() == (applied, why)  # idempotent
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = 40 << 20
def use():
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)
ratio = []
def rounds():
    use()  # first use: these faults are expected
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        use()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    ratio.append(faults / 10 / (SIZE // 4096))
t = threading.Thread(target=rounds)
t.start()
t.join()
print(ratio[0])
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc malloc's",
)


def _python(code: str, *args: str) -> str:
    """stdout of `code` run by a fresh interpreter in the repository root."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _faults_per_page(mode: str) -> float:
    return float(_python(PROBE, mode))


@glibc
def test_glibc_defaults_fault_every_page_of_a_reused_large_block():
    # The control: without the settings each reuse maps fresh pages.
    assert _faults_per_page("default") > 0.9


@glibc
def test_kept_memory_is_reused_without_faults():
    assert _faults_per_page("keep") < 0.05


def test_importing_actors_applies_it_and_still_not_torch():
    probe = (
        "import sys, actors\n"
        "from kernels.host_memory import keep_freed_memory\n"
        "assert 'torch' not in sys.modules\n"
        "print(keep_freed_memory()[1])\n"
    )
    assert _python(probe).strip()  # the reason, applied or not
