"""Before the GPU check runs on a machine kvactor did not install: is every package there?

    python3 -m actors.bench.device_preflight       (bin/gpu-device-check runs it first)

Checks, and prints as one JSON line: the Python version; each package the image must
provide (`IMAGE_MINIMUMS`) at or above the oldest version kvactor runs with; each wheelhouse
package (configs/gpu-wheelhouse.txt) at exactly its listed version; whether torch sees CUDA.
Exits 3 naming every problem, so a missing or stale package stops the check in seconds
instead of failing an import minutes into it.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

WHEELHOUSE_LIST = Path(__file__).resolve().parents[2] / "configs" / "gpu-wheelhouse.txt"

# What the GPU machine's image provides, and the oldest version of each kvactor runs with
# (the image's own versions when written: torch 2.11, triton 3.6, transformers 5.17).
IMAGE_MINIMUMS = {
    "torch": "2.11",
    "triton": "3.6",
    "transformers": "5.0",
    "tokenizers": "0.22",
    "safetensors": "0.4",
    "numpy": "2.0",
    "anyio": "4.0",
    "jinja2": "3.1",
    "prometheus-client": "0.20",
    "h11": "0.14",
    "click": "8.0",
    "tqdm": "4.60",
    "regex": "2023.0",
    "pyyaml": "6.0",
}


def version_tuple(text: str) -> tuple[int, ...]:
    """(2, 11, 0) of "2.11.0+cu130"; non-numeric tails are ignored."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def wheelhouse_pins(path: Path = WHEELHOUSE_LIST) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip()] = version.strip()
    return pins


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(
    minimums: dict[str, str] = IMAGE_MINIMUMS, pins: dict[str, str] | None = None
) -> tuple[dict, list[str]]:
    """(what was found, the problems)."""
    pins = wheelhouse_pins() if pins is None else pins
    found: dict = {"python": sys.version.split()[0]}
    problems = []
    if version_tuple(found["python"]) < (3, 11):  # runs under any python3 the machine has
        problems.append(f"python {found['python']}: kvactor needs 3.11 or newer")
    for name, oldest in minimums.items():
        have = found[name] = installed(name)
        if have is None:
            problems.append(f"{name}: not installed (the image should have it)")
        elif version_tuple(have) < version_tuple(oldest):
            problems.append(f"{name} {have}: kvactor needs {oldest} or newer")
    for name, want in pins.items():
        have = found[name] = installed(name)
        if have != want:
            problems.append(f"{name}: {have or 'not installed'}, the wheelhouse has {want}")
    return found, problems


def main() -> int:
    found, problems = check()
    try:
        import torch

        found["cuda"] = torch.cuda.is_available()
    except ImportError:
        pass
    print(json.dumps({"preflight": found, "problems": problems}))
    if problems:
        print("device preflight failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
