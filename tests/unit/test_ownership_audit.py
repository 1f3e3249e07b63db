"""Ownership audit: every write to a `ReqKvInfo` field is a reviewed site.

Scans the repository's source (AST) for assignments, augmented assignments and
`setattr` calls that write one of the record's fields, plus calls to
`mark_released()`, and compares (file, function, field) -> count with the table
below. A site that appears or vanishes fails the test by name: moving KV
bookkeeping is a design change and must update this table in the same commit.
Every site lives in the allocator's code (actors/allocator/) or in the record's
own `mark_released`.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("actors", "kvcore", "kernels", "transport", "bin")
FIELDS = {
    "req_pool_idx",
    "cache_protected_len",
    "kv_committed_len",
    "kv_allocated_len",
    "swa_evict_floor",
    "swa_evicted_seqlen",
}
ALLOWED_DIRS = ("actors/allocator/", "kvcore/req_kv_info.py")

# (file, enclosing function, field or "mark_released()") -> number of write sites
OWNER_SITES: dict[tuple[str, str, str], int] = {
    ("kvcore/req_kv_info.py", "ReqKvInfo.mark_released", "cache_protected_len"): 1,
    ("kvcore/req_kv_info.py", "ReqKvInfo.mark_released", "kv_committed_len"): 1,
    ("kvcore/req_kv_info.py", "ReqKvInfo.mark_released", "kv_allocated_len"): 1,
    ("kvcore/req_kv_info.py", "ReqKvInfo.mark_released", "swa_evict_floor"): 1,
    ("kvcore/req_kv_info.py", "ReqKvInfo.mark_released", "swa_evicted_seqlen"): 1,
    # admission + every prefill chunk: allocation commits
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "req_pool_idx"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "cache_protected_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "kv_allocated_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "kv_committed_len"): 1,
    # one decode step: allocation commits
    ("actors/allocator/ledger.py", "KvLedger.alloc_decode", "kv_allocated_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_decode", "kv_committed_len"): 1,
    # chunked prefill: finished pages move into the tree
    ("actors/allocator/ledger.py", "KvLedger.cache_unfinished", "cache_protected_len"): 1,
    # finish / abort / retract all end here
    ("actors/allocator/ledger.py", "KvLedger._release", "req_pool_idx"): 1,
    ("actors/allocator/ledger.py", "KvLedger._release", "mark_released()"): 1,
}


def _scan() -> Counter:
    sites: Counter = Counter()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            _visit(tree, rel, [], sites)
    return sites


def _visit(node: ast.AST, rel: str, scope: list[str], sites: Counter) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _visit(child, rel, scope + [child.name], sites)
            continue
        where = ".".join(scope) or "<module>"
        for field in _written_fields(child):
            sites[(rel, where, field)] += 1
        _visit(child, rel, scope, sites)


def _written_fields(node: ast.AST) -> list[str]:
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = [t for tgt in node.targets for t in _flatten(tgt)]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and arg.value in FIELDS:
                return [arg.value]
        if isinstance(func, ast.Attribute) and func.attr == "mark_released":
            return ["mark_released()"]
        return []
    return [t.attr for t in targets if isinstance(t, ast.Attribute) and t.attr in FIELDS]


def _flatten(target: ast.AST) -> list[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for elt in target.elts for t in _flatten(elt)]
    return [target]


def test_every_reqkvinfo_write_site_is_listed():
    found = _scan()
    new = {k: v for k, v in found.items() if OWNER_SITES.get(k) != v}
    gone = {k: v for k, v in OWNER_SITES.items() if found.get(k) != v}
    msgs = [f"new or changed write site {k}: {v} write(s)" for k, v in sorted(new.items())]
    msgs += [f"listed site {k} ({v}) no longer found" for k, v in sorted(gone.items())]
    assert not msgs, "ReqKvInfo ownership table out of date:\n" + "\n".join(msgs)


def test_every_site_is_in_the_allocator():
    outside = [k for k in OWNER_SITES if not k[0].startswith(ALLOWED_DIRS)]
    assert not outside, f"ReqKvInfo written outside the allocator: {outside}"


def test_scanner_sees_writes(tmp_path):
    code = "def f(r):\n    r.kv_committed_len += 1\n    (a, r.req_pool_idx) = 1, 2\n"
    code += "    setattr(r, 'swa_evict_floor', 3)\n    r.kv.mark_released()\n    r.other = 1\n"
    sites: Counter = Counter()
    _visit(ast.parse(code), "x.py", [], sites)
    assert sites == Counter(
        {
            ("x.py", "f", "kv_committed_len"): 1,
            ("x.py", "f", "req_pool_idx"): 1,
            ("x.py", "f", "swa_evict_floor"): 1,
            ("x.py", "f", "mark_released()"): 1,
        }
    )
