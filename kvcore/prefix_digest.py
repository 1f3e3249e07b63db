"""A prefix tree's content as a compact set of hashes, and a token sequence's hashes to match.

Block k of a key sequence is its tokens [k * block, (k + 1) * block). Its hash stands for the
whole prefix up to the block's end: h_k = mix(h_{k-1}, block k's tokens), with h_{-1} = 0. So
a set of such hashes is closed under prefixes when the tree is (a prefix tree's is), and the
longest cached prefix of a sequence is the longest run of its leading hashes in the set,
found by binary search. The router matches prompts against each replica's set this way.

Hashes are 64-bit and stable across processes and machines (no per-process seed): the
router and every replica compute the same value for the same keys. They are not
cryptographic: a collision costs one routing decision, never a wrong answer (a replica
matches the real tokens itself).
"""

from __future__ import annotations

import numpy as np

DIGEST_BLOCK = 64  # tokens per hashed block
MAX_DIGEST_BLOCKS = 1 << 17  # a digest lists at most this many prefixes (1 MiB)

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_ODD = np.uint64(0x100000001B3)  # the polynomial's base (odd: every power is invertible)
_POWERS: dict[int, np.ndarray] = {}


def _powers(block: int) -> np.ndarray:
    p = _POWERS.get(block)
    if p is None:
        with np.errstate(over="ignore"):
            p = np.cumprod(np.full(block, _ODD, dtype=np.uint64), dtype=np.uint64)
        _POWERS[block] = p
    return p


def _mix(z: int) -> int:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def extend_hashes(prev: int, keys: np.ndarray, block: int) -> list[int]:
    """The hashes of `keys`' whole blocks, continuing a chain whose last hash is `prev`
    (`keys` starts on a block boundary; a trailing partial block is not hashed)."""
    n = len(keys) // block
    if n == 0:
        return []
    blocks = np.ascontiguousarray(keys[: n * block], dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        sums = (blocks.reshape(n, block) * _powers(block)).sum(axis=1, dtype=np.uint64)
    out = []
    for value in sums.tolist():
        prev = _mix((prev * _GOLDEN + value) & _MASK)
        out.append(prev)
    return out


def prefix_hashes(keys, block: int = DIGEST_BLOCK) -> list[int]:
    """Entry k stands for the prefix keys[: (k + 1) * block] (whole blocks only)."""
    return extend_hashes(0, np.asarray(keys, dtype=np.int64), block)


def matched_blocks(hashes: list[int], held) -> int:
    """How many leading entries of `hashes` (a sequence's `prefix_hashes`) are in `held`
    (a prefix-closed set or mapping of hashes)."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pack(hashes) -> bytes:
    return np.asarray(hashes, dtype=np.uint64).astype("<u8").tobytes()


def unpack(raw: bytes) -> set[int]:
    if len(raw) % 8:
        raise ValueError(f"a digest is whole 8-byte hashes, got {len(raw)} bytes")
    return set(np.frombuffer(raw, dtype="<u8").tolist())
