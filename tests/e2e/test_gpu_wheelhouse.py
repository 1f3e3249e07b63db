"""The GPU check's path on a machine kvactor did not install, rehearsed on the CPU.

The GPU machine has no network and its own python3: bin/gpu-device-check installs the
carried wheelhouse with `--no-index` and runs the check. Here a fresh venv stands in for
that python3: it sees exactly the image's packages (configs/gpu-device-packages.txt, those
installed here: the CUDA parts are not) and nothing of the project's venv, and the
wheelhouse is built for this machine's Python (`bin/gpu-wheelhouse --host`, the same list).
Also: the device's own wheelhouse (CPython 3.12, manylinux) downloads complete, and the
`gpu` extra resolves beside the triton that torch's CUDA wheels pin.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from actors.bench.device_preflight import wheelhouse_pins

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_names() -> set[str]:
    text = (ROOT / "configs" / "gpu-device-packages.txt").read_text()
    return {norm(w) for line in text.splitlines() if not line.startswith("#") for w in line.split()}


def image_closure() -> dict[str, metadata.Distribution]:
    """The installed distributions the image has, with what they need in turn (the image's
    own packages have their needs met there, in whatever versions it holds), except the
    wheelhouse's: those must come from the wheelhouse."""
    wheelhouse = {norm(n) for n in wheelhouse_pins()}
    installed = {
        norm(d.metadata["Name"]): d
        for d in metadata.distributions()
        if norm(d.metadata["Name"]) not in wheelhouse
    }
    todo = [n for n in image_names() if n in installed]
    found: dict[str, metadata.Distribution] = {}
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found[name] = dist = installed[name]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                if norm(req.name) in installed:
                    todo.append(norm(req.name))
    return found


def link_image_packages(dest: Path) -> list[str]:
    """Symlink into `dest` the files of `image_closure()`'s distributions."""
    dest.mkdir()
    for dist in image_closure().values():
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = base / top
            if src.exists() and not (dest / top).exists() and not top.endswith(".pth"):
                (dest / top).symlink_to(src)
    return sorted(image_closure())


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p
    )
    env.update(extra)
    return env


def test_device_wheelhouse_downloads_complete(tmp_path):
    dest = tmp_path / "whl"
    subprocess.run([str(ROOT / "bin" / "gpu-wheelhouse"), "--dest", str(dest)], check=True)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    assert len(wheels) == len(wheelhouse_pins())
    for name in wheels:  # built for the GPU machine's CPython 3.12 on x86-64 Linux
        assert re.search(r"-(cp312-cp312|cp312-abi3|py3-none)-(manylinux\S*x86_64|any)\.whl$", name)


def test_gpu_extra_resolves_beside_torchs_triton_pin():
    """torch 2.13.0's CUDA wheels require triton==3.7.1: the extra must not pin another."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "-q",
            f"{ROOT}[gpu]",
            "triton==3.7.1",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]


def test_gpu_check_dry_run_in_a_fresh_venv_from_the_wheelhouse(tmp_path):
    wheels = tmp_path / "whl"
    subprocess.run(
        [str(ROOT / "bin" / "gpu-wheelhouse"), "--host", "--dest", str(wheels)], check=True
    )
    image = tmp_path / "image-site"
    linked = link_image_packages(image)
    assert "torch" in linked and "transformers" in linked
    python_dir = tmp_path / "device-python"
    venv.EnvBuilder(with_pip=True).create(python_dir)
    python = python_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "device-image.pth").write_text(f"{image}\n")
    # The stand-in sees none of the project's own dependencies until the wheelhouse is in.
    probe = subprocess.run([str(python), "-c", "import msgspec"], env=clean_env())
    assert probe.returncode != 0

    report = tmp_path / "gpu-check.json"
    run = subprocess.run(
        [
            str(ROOT / "bin" / "gpu-device-check"),
            "--dry-run",
            "--random-weights",
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(report),
            "--batches",
            "1",
            "2",
            "--parity-prompts",
            "2",
            "--parity-tokens",
            "4",
            "--new-tokens",
            "4",
            "--bandwidth-steps",
            "2",
        ],
        env=clean_env(
            PYTHON=str(python),
            KVACTOR_WHEELHOUSE=str(wheels),
            KVACTOR_DEVICE_SITE=str(tmp_path / "site"),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
        ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    preflight = json.loads(run.stdout.splitlines()[0])
    assert preflight["problems"] == []
    assert preflight["preflight"]["msgspec"] == wheelhouse_pins()["msgspec"]
    out = json.loads(report.read_text())
    assert out["parity"]["passed"] and out["parity"]["window_prompts"] == 1
    assert set(out["parity"]["runs"]) == {"torch/one_pool", "torch/sliding_pool"}
    assert set(out["throughput"]) == {"1", "2"} and out["batch1"]["step_ms"] > 0
    assert out["unmet_requirements"] == []
