"""Ownership audit: every write to a `ReqKvInfo` field is a reviewed site.

Scans the repository's source (AST) for every way to write one of the record's fields:
assignment targets of every kind (plain, augmented, annotated, tuple / list / starred,
`for`, `with`, comprehension), `del`, `setattr` / `builtins.setattr` /
`object.__setattr__` / `x.__setattr__` (a computed attribute name counts as a write of
"<computed>"), `dataclasses.replace` / `replace` with a field keyword, constructing
`ReqKvInfo(...)`, and calls to `mark_released()`; and compares (file, function, field) ->
count with the table below. A site that appears or vanishes fails the test by name: moving KV
bookkeeping is a design change and must update this table in the same commit.
Every site lives in the allocator's code (actors/allocator/) or in the record's
own `mark_released`.
"""

from __future__ import annotations

import ast
import shutil
from collections import Counter
from pathlib import Path

import pytest

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
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "ReqKvInfo()"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "req_pool_idx"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "cache_protected_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "kv_allocated_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "kv_committed_len"): 1,
    # one decode step: allocation commits
    ("actors/allocator/ledger.py", "KvLedger.alloc_decode", "kv_allocated_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger.alloc_decode", "kv_committed_len"): 1,
    # chunked prefill: finished pages move into the tree
    ("actors/allocator/ledger.py", "KvLedger.cache_unfinished", "cache_protected_len"): 1,
    # the prompt keeps its sliding KV (unless kv.swa_free_prompt)
    ("actors/allocator/ledger.py", "KvLedger.alloc_extend", "swa_evict_floor"): 1,
    ("actors/allocator/ledger.py", "KvLedger._restore", "swa_evict_floor"): 1,
    # admission of a session's turn on the session's record: trimmed, then extended
    ("actors/allocator/ledger.py", "KvLedger._restore", "kv_allocated_len"): 1,
    ("actors/allocator/ledger.py", "KvLedger._restore", "kv_committed_len"): 1,
    # the sliding window passed these positions: their sliding-layer pages are freed
    ("actors/allocator/ledger.py", "KvLedger._free_window", "swa_evicted_seqlen"): 1,
    # finish / abort / retract / session close all end here
    ("actors/allocator/ledger.py", "KvLedger._free_record", "req_pool_idx"): 1,
    ("actors/allocator/ledger.py", "KvLedger._free_record", "mark_released()"): 1,
}


def _scan(root: Path = ROOT) -> Counter:
    sites: Counter = Counter()
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else []:
            rel = path.relative_to(root).as_posix()
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


_SETATTR = {"setattr", "__setattr__"}


def _written_fields(node: ast.AST) -> list[str]:
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, ast.comprehension):
        targets = [node.target]
    elif isinstance(node, ast.withitem):
        targets = [node.optional_vars] if node.optional_vars is not None else []
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.Call):
        return _call_writes(node)
    flat = [t for tgt in targets for t in _flatten(tgt)]
    return [t.attr for t in flat if isinstance(t, ast.Attribute) and t.attr in FIELDS]


def _call_writes(call: ast.Call) -> list[str]:
    func = call.func
    name = (
        func.id
        if isinstance(func, ast.Name)
        else func.attr
        if isinstance(func, ast.Attribute)
        else None
    )
    if name in _SETATTR:
        # setattr(obj, "f", v), builtins.setattr(obj, "f", v), object.__setattr__(obj, "f",
        # v): the name is the second argument; obj.__setattr__("f", v): the first.
        bound = (
            isinstance(func, ast.Attribute)
            and name == "__setattr__"
            and not (isinstance(func.value, ast.Name) and func.value.id == "object")
        )
        args = call.args[0:] if bound else call.args[1:]
        if not args:
            return []
        arg = args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [arg.value] if arg.value in FIELDS else []
        return ["<computed>"]
    if name == "mark_released" and isinstance(func, ast.Attribute):
        return ["mark_released()"]
    if name == "replace":
        return [kw.arg for kw in call.keywords if kw.arg in FIELDS]
    if name == "ReqKvInfo":
        return ["ReqKvInfo(...)" if call.args or call.keywords else "ReqKvInfo()"]
    return []


def _flatten(target: ast.AST) -> list[ast.AST]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for elt in target.elts for t in _flatten(elt)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def audit_errors(root: Path = ROOT) -> list[str]:
    found = _scan(root)
    new = {k: v for k, v in found.items() if OWNER_SITES.get(k) != v}
    gone = {k: v for k, v in OWNER_SITES.items() if found.get(k) != v}
    msgs = [f"new or changed write site {k}: {v} write(s)" for k, v in sorted(new.items())]
    msgs += [f"listed site {k} ({v}) no longer found" for k, v in sorted(gone.items())]
    return msgs


def test_every_reqkvinfo_write_site_is_listed():
    msgs = audit_errors()
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


# Each writes a ReqKvInfo field in a way an earlier scanner missed; planted in a copy of the
# tree (outside the allocator), the audit must fail on it.
BYPASSES = {
    "setattr with a computed name": "def f(r, n):\n    setattr(r, n, 0)\n",
    "builtins.setattr": "import builtins\ndef f(r):\n"
    "    builtins.setattr(r, 'kv_committed_len', 0)\n",
    "object.__setattr__": "def f(r):\n    object.__setattr__(r, 'req_pool_idx', None)\n",
    "bound __setattr__": "def f(r):\n    r.__setattr__('kv_allocated_len', 0)\n",
    "starred target": "def f(r, xs):\n    a, *r.kv_allocated_len = xs\n",
    "for-loop target": "def f(r):\n    for r.kv_committed_len in range(3):\n        pass\n",
    "with target": "def f(r, c):\n    with c as r.cache_protected_len:\n        pass\n",
    "comprehension target": "def f(rs):\n    return [0 for r.swa_evicted_seqlen in rs]\n",
    "del": "def f(r):\n    del r.kv_committed_len\n",
    "dataclasses.replace": "import dataclasses\ndef f(r):\n"
    "    return dataclasses.replace(r, kv_committed_len=9)\n",
    "a record built with values": "from kvcore import ReqKvInfo\ndef f():\n"
    "    return ReqKvInfo(req_pool_idx=3, kv_allocated_len=16)\n",
    "a record built outside the allocator": "from kvcore import ReqKvInfo\ndef f():\n"
    "    return ReqKvInfo()\n",
}


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("audit")
    for top in SCANNED:
        if (ROOT / top).is_dir():
            shutil.copytree(ROOT / top, root / top, ignore=shutil.ignore_patterns("__pycache__"))
    assert audit_errors(root) == []  # the copy itself is clean
    return root


@pytest.mark.parametrize("name", sorted(BYPASSES))
def test_each_bypass_fails_the_audit(tree_copy, name):
    planted = tree_copy / "actors" / "scheduler" / "planted.py"
    planted.write_text(BYPASSES[name])
    try:
        errors = audit_errors(tree_copy)
    finally:
        planted.unlink()
    assert any("actors/scheduler/planted.py" in e for e in errors), (name, errors)
