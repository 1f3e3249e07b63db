"""Keep freed host memory in the process, so hot-path tensors don't page-fault every step.

glibc's malloc hands any block above its mmap threshold (128 KiB at start, raised
dynamically to at most 32 MiB) to the kernel on `free` and maps fresh zero pages on the
next `malloc`; a block freed at the top of the heap beyond the trim threshold is given back
too. A CPU decode step allocates the same large tensors every time (the [batch, vocab]
float32 logits are 32 MiB at batch 32 for a 262k vocabulary), so each step paid one page
fault per 4 KiB page of them: 8,193 faults, about as long as the whole LM-head widening.

`keep_freed_memory()` raises the mmap threshold to 256 MiB (so a step's large blocks come
from the heap and are reused once freed) and the trim threshold to 512 MiB (a step's blocks
never free that much at once, so steady serving keeps them; freeing a whole model does, and
that goes back to the kernel), and keeps every thread on the main arena (a thread's own
arena grows in 64 MiB heaps, which cannot hold a larger block, so those would still be
mapped per call). Blocks over 256 MiB (a vocabulary-sized embedding, say) are still mapped
and unmapped by themselves. The price: up to 512 MiB of freed heap stays resident, as with
tcmalloc or jemalloc, which CPU inference servers commonly preload for the same reason.

It is process-wide, idempotent, and a no-op (with the reason) where malloc is not glibc's.
Call it before the threads that compute are started: a thread keeps the arena it first got.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 << 20  # blocks up to 256 MiB come from the heap
TRIM_THRESHOLD = 512 << 20  # the heap's free top goes back to the kernel beyond 512 MiB

_lock = threading.Lock()
_outcome: tuple[bool, str] | None = None


def keep_freed_memory() -> tuple[bool, str]:
    """Configure glibc malloc as described above; returns (applied, why), once per process."""
    global _outcome
    with _lock:
        if _outcome is None:
            _outcome = _apply()
        return _outcome


def _apply() -> tuple[bool, str]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False, "not glibc: the system allocator is left as it is"
    version.restype = ctypes.c_char_p
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        )
    )
    glibc = version().decode()
    if not applied:
        return False, f"glibc {glibc} refused the malloc settings; left as they were"
    return True, (
        f"glibc {glibc}: freed blocks up to {MMAP_THRESHOLD >> 20} MiB stay in the heap, "
        "one arena (no per-step page faults on large tensors)"
    )
