"""The README stays a five-minute read that reaches every doc, and no doc links to a file
that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_CHARS = 12_000
# [text](target): a relative target (no scheme, no pure #anchor)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _relative_links(doc: Path) -> list[str]:
    return [t for t in LINK.findall(doc.read_text()) if "://" not in t]


def test_the_readme_is_short():
    chars = len((ROOT / "README.md").read_text())
    assert chars < README_MAX_CHARS, f"README.md has {chars} characters (< {README_MAX_CHARS})"


def test_the_readme_links_every_doc():
    linked = {(ROOT / t).resolve() for t in _relative_links(ROOT / "README.md")}
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs
    missing = [d.name for d in docs if d.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


def test_relative_links_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in _relative_links(doc):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
