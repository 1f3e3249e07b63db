"""The import graph of actors/, kernels/, kvcore/ and transport/: no cycle between files, and
the layering of DESIGN.md (which package may import what).

Static: every `.py` file is parsed with `ast`, nothing is imported (no torch needed, and a
module's import-time side effects cannot hide or add an edge). Every import statement
counts, wherever it is: module level, inside a function, under `if TYPE_CHECKING:`; each is
a dependency a reader has to follow. Absolute and relative imports are resolved to the
modules of these packages; `from pkg import name` depends on `pkg` and, when `name` is a
submodule, on `pkg.name` too. A package's `__init__` counts when it is named, not merely
as the parent of a submodule that is imported.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "kernels", "kvcore", "transport")

# DESIGN.md's layering. Packages of this repository a package must not import:
FORBIDDEN = {
    "kvcore": {"actors", "kernels", "transport"},  # pure bookkeeping, actor-free
    "kernels": {"actors", "transport"},  # "kernels knows nothing of actors or messages"
    "transport": {"actors", "kernels", "kvcore"},  # the protocol knows no actors
}
# ... and the only third-party packages it may import (the standard library is always fine):
THIRD_PARTY_ONLY = {
    "kvcore": {"numpy"},  # "numpy only (no torch, no zmq)"
    "transport": {"msgspec", "zmq", "anyio"},
}


@dataclass(frozen=True)
class Import:
    name: str  # absolute dotted name, as written or resolved from a relative import
    line: int


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path) -> Iterator[Import]:
    """Every name the file imports, absolute; `from a import b` yields `a` and `a.b`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(package) - 1:
                    continue  # above the top package: not ours (and not importable)
                parts = package[: len(package) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            yield Import(base, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(f"{base}.{alias.name}", node.lineno)


def resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module `name` lives in (its longest prefix that is a module), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, Import]]:
    """module -> {module it imports: the first import statement that does}."""
    modules = module_files(root, packages)
    graph: dict[str, dict[str, Import]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for imp in imports_of(module, path):
            target = resolve(imp.name, modules)
            if target is not None and target != module:
                edges.setdefault(target, imp)
    return graph


def find_cycles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The shortest cycle through each module that lies on one, each once: [a, b, ..., a]."""
    found: dict[tuple[str, ...], list[str]] = {}
    for start in sorted(graph):
        # Breadth-first from start's imports back to start: the shortest way round.
        parent: dict[str, str] = {}
        queue = deque()
        for first in sorted(graph[start]):
            if first not in parent:
                parent[first] = start
                queue.append(first)
        while queue:
            node = queue.popleft()
            if node == start:
                break
            for nxt in sorted(graph.get(node, ())):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        if start not in parent:
            continue
        path = [start]
        node = parent[start]
        while node != start:
            path.append(node)
            node = parent[node]
        path.reverse()  # start -> ... -> (back to start)
        i = path.index(min(path))
        ring = tuple(path[i:] + path[:i])  # the same cycle found from any member is one
        found.setdefault(ring, [*ring, ring[0]])
    return list(found.values())


def describe_cycles(
    cycles: list[list[str]], graph: Mapping[str, Mapping[str, Import]], root: Path
) -> str:
    files = module_files(root)
    lines = []
    for cycle in cycles:
        lines.append("  " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            where = files[a].relative_to(root).as_posix()
            lines.append(f"      {where}:{graph[a][b].line} imports {graph[a][b].name}")
    return "\n".join(lines)


def layering_violations(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Each import statement that breaks `FORBIDDEN` or `THIRD_PARTY_ONLY`, once."""
    out = {}
    stdlib = sys.stdlib_module_names
    for module, path in module_files(root, packages).items():
        package = module.split(".")[0]
        for imp in imports_of(module, path):
            top = imp.name.split(".")[0]
            rel = path.relative_to(root).as_posix()
            if (rel, imp.line, top) in out:
                continue  # `from a.b import c`: one statement, one line
            where = f"{rel}:{imp.line} imports {imp.name}"
            if top in FORBIDDEN.get(package, ()):
                out[rel, imp.line, top] = f"{where} ({package} must not import {top})"
            allowed = THIRD_PARTY_ONLY.get(package)
            if (
                allowed is not None
                and top not in stdlib
                and top not in PACKAGES
                and top not in allowed
            ):
                out[rel, imp.line, top] = (
                    f"{where} ({package} may import only {sorted(allowed)} beyond stdlib)"
                )
    return sorted(out.values())


def test_no_import_cycle_between_files():
    graph = import_graph(ROOT)
    # The walk sees the tree (a broken walk must not pass by finding nothing).
    assert len(graph) > 100
    assert "actors.app.config" in graph["actors.app.cli"]
    assert "kernels.quant" in graph["kernels.lm_head"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + describe_cycles(cycles, graph, ROOT)


def test_packages_import_only_what_their_layer_may():
    problems = layering_violations(ROOT)
    assert not problems, "layering (DESIGN.md) broken:\n  " + "\n  ".join(problems)


# ---- the checker itself ---------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_sees_every_kind_of_import(tmp_path):
    _write(
        tmp_path,
        {
            "actors/__init__.py": "",
            "actors/a.py": "def f():\n    from actors import b  # function level, a submodule\n",
            "actors/b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from .sub.c import C  # relative\n"
            ),
            "actors/sub/__init__.py": "",
            "actors/sub/c.py": "from .. import a\nimport actors.sub.d as d\n",
            "actors/sub/d.py": "from actors.sub import c\nfrom . import e\n",
            "actors/sub/e.py": "import kvcore.x\nfrom kvcore.x import thing\n",
            "kvcore/__init__.py": "",
            "kvcore/x.py": "thing = 1\n",
        },
    )
    graph = import_graph(tmp_path)
    assert set(graph["actors.sub.e"]) == {"kvcore.x"}  # `thing` is a name, not a module
    assert find_cycles(graph) == [
        ["actors.a", "actors.b", "actors.sub.c", "actors.a"],
        ["actors.sub.c", "actors.sub.d", "actors.sub.c"],
    ]
    text = describe_cycles(find_cycles(graph), graph, tmp_path)
    assert "actors.a -> actors.b -> actors.sub.c -> actors.a" in text
    assert "actors/b.py:3 imports actors.sub.c\n" in text


def test_checker_sees_layering_breaks(tmp_path):
    _write(
        tmp_path,
        {
            "kvcore/__init__.py": "import numpy\nimport os\n",
            "kvcore/pool.py": "def f():\n    import torch\n",
            "kernels/__init__.py": "from kvcore import pool\n",
            "kernels/m.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from actors.x import Y\n"
            ),
            "transport/__init__.py": "import msgspec, zmq, anyio\nfrom kernels import m\n",
            "actors/__init__.py": "import kernels, kvcore, transport, torch\n",
        },
    )
    assert layering_violations(tmp_path) == [
        "kernels/m.py:3 imports actors.x (kernels must not import actors)",
        "kvcore/pool.py:2 imports torch (kvcore may import only ['numpy'] beyond stdlib)",
        "transport/__init__.py:2 imports kernels (transport must not import kernels)",
    ]
