"""kvcore: pure, synchronous KV bookkeeping (no torch, no sockets).

Owns the data structures the allocator actor is built from: the per-request
record (`ReqKvInfo`), the page pool, the req-to-token table, the radix
(prefix) tree, and the invariant checker that audits them together.
"""

from kvcore.invariants import (
    InvariantViolation,
    KvSnapshot,
    check_idle,
    check_invariants,
    swa_idle_problems,
)
from kvcore.page_pool import PageDoubleFree, PageNotOwned, PagePool, PoolError
from kvcore.radix_tree import MatchResult, RadixTree, TreeSnapshot
from kvcore.req_kv_info import ReqKvInfo
from kvcore.req_to_token import ReqToTokenTable, RowError
from kvcore.slots import ceil_page, floor_page, pages_of_slots, slots_of_pages
from kvcore.swa_pages import SwaPages

__all__ = [
    "InvariantViolation",
    "KvSnapshot",
    "MatchResult",
    "PageDoubleFree",
    "PageNotOwned",
    "PagePool",
    "PoolError",
    "RadixTree",
    "ReqKvInfo",
    "ReqToTokenTable",
    "RowError",
    "SwaPages",
    "TreeSnapshot",
    "ceil_page",
    "check_idle",
    "check_invariants",
    "floor_page",
    "pages_of_slots",
    "slots_of_pages",
    "swa_idle_problems",
]
