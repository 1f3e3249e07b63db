"""Prefix-cache namespaces (`cache_salt`): a salt gives a request's tokens keys of their own.

The prefix tree matches token ids. A salted request's ids are lifted into a key space no
unsalted or differently salted request reaches: key = token + (h << 32), with h a 31-bit
hash of the salt (h >= 1). Token ids stay below 2**32, so two different keys never
collide with an unsalted id, and two salts collide only when their hashes do (2**-31).
Everything that compares token sequences for KV reuse (the tree, session slots) sees the
keys, so isolation needs no other code path.
"""

from __future__ import annotations

import hashlib

import numpy as np

_TOKEN_BITS = 32


def salt_key(salt: str) -> int:
    """The salt's namespace (0: the shared one, for the empty salt)."""
    if not salt:
        return 0
    digest = hashlib.blake2b(salt.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & 0x7FFF_FFFF) | 1


def salted_tokens(tokens, salt: str) -> np.ndarray:
    """The keys of `tokens` in `salt`'s namespace (a copy; the ids themselves when unsalted)."""
    ids = np.asarray(tokens, dtype=np.int64)
    ns = salt_key(salt)
    if not ns:
        return ids
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << _TOKEN_BITS):
        raise ValueError("token ids must lie in [0, 2**32) to be salted")
    return ids + (ns << _TOKEN_BITS)
