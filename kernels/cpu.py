"""What this CPU computes well, and the runner settings that follow (chosen at run time).

Machines differ: a CPU with AVX512-BF16 or AMX multiplies bf16 natively, and there bf16
weights halve the memory a decode step streams; on an AVX2-only CPU the same bf16 matmul is
emulated (several times slower than fp32) and oneDNN's bf16 path may refuse to run. So the
default `model.dtype = "auto"` picks bf16 only where the CPU has native bf16 (AVX512-BF16,
AMX-BF16 or AVX-NE-CONVERT) and oneDNN accepts bf16, fp32 everywhere else; every choice
comes with the reason, which the runner logs.

Instructions: kvactor uses none wider than torch dispatches to. Where torch's level is
below AVX-512 (an AVX2-only CPU, or `ATEN_CPU_CAPABILITY=avx2`, torch's own variable, on a
wider one), the AVX-512 and AMX flags count as absent: no native bf16, and the Q8_0 kernel
builds without AVX-512 (`avx512_disabled`). With oneDNN and fbgemm held to AVX2 as well
(`actors/__init__.py` does it), one variable makes the whole engine choose and compute as on
an AVX2-only CPU.

Threads: `model.threads = 0` ("auto") gives the runner every core it may run on, in its own
process or in the control plane's (measured with `bin/engine bench serve`: the actors'
Python work between steps costs less than the core it would reserve).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # torch's dispatch level: "AVX2", "AVX512", ...
    flags: frozenset[str]  # /proc/cpuinfo flags (empty where unreadable)
    native_bf16: bool  # bf16 multiply in hardware
    onednn_bf16: bool  # oneDNN will run bf16 kernels here (natively or emulated)
    cores: int  # CPUs this process may run on

    def describe(self) -> str:
        native = [f for f in NATIVE_BF16_FLAGS if f in self.flags]
        return (
            f"{self.capability}, {self.cores} cores, native bf16: "
            f"{', '.join(native) if native else 'none'}"
        )


# instruction-set flags beyond torch's dispatch level when it is below AVX-512
_WIDE_FLAG_PREFIXES = ("avx512", "amx")


def avx512_disabled() -> bool:
    """Whether this CPU has AVX-512 that torch's dispatch level leaves unused (`AVX2` or
    `DEFAULT`, as `ATEN_CPU_CAPABILITY` sets), so kvactor's code must not use it either."""
    level = torch.backends.cpu.get_cpu_capability()
    return "avx512f" in _cpuinfo_flags() and not level.startswith("AVX512")


@cache
def cpu_features() -> CpuFeatures:
    flags = _cpuinfo_flags()
    capped = avx512_disabled()
    if capped:
        flags = {f for f in flags if not f.startswith(_WIDE_FLAG_PREFIXES)}
    native = bool(flags & set(NATIVE_BF16_FLAGS))
    cpu = getattr(torch, "cpu", None)
    if not capped and cpu is not None and hasattr(cpu, "_is_avx512_bf16_supported"):
        native = native or bool(cpu._is_avx512_bf16_supported())
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = False
    return CpuFeatures(
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=frozenset(flags),
        native_bf16=native,
        onednn_bf16=onednn,
        cores=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else (os.cpu_count() or 1),
    )


@cache
def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def choose_dtype(requested: str, device: str = "cpu") -> tuple[torch.dtype, str]:
    """The weight dtype for `requested` ("auto" or a dtype name), and why."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {requested!r}")
        dtype = _DTYPES[requested]
        if dtype == torch.bfloat16 and device == "cpu" and not cpu_features().onednn_bf16:
            raise ValueError(
                f"dtype {requested} cannot run on this CPU ({cpu_features().describe()}): "
                "oneDNN refuses bf16 here; use auto or float32"
            )
        return dtype, "set in the config"
    if device != "cpu":
        return torch.bfloat16, f"auto: bf16 on {device}"
    f = cpu_features()
    if f.native_bf16 and f.onednn_bf16:
        return torch.bfloat16, f"auto: this CPU computes bf16 natively ({f.describe()})"
    return torch.float32, f"auto: no native bf16 on this CPU, fp32 is faster ({f.describe()})"


def choose_threads(requested: int, own_process: bool) -> tuple[int, str]:
    """torch threads for the runner: `requested` when > 0, else OMP_NUM_THREADS where it is
    set (the usual way to give a process its share of a shared machine), else every core
    the process may run on."""
    if requested > 0:
        return requested, "set in the config"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), f"auto: OMP_NUM_THREADS={omp}"
    cores = cpu_features().cores
    where = "its own process" if own_process else "the control plane's process"
    return cores, f"auto: every core ({cores}), the runner in {where}"


def one_thread_here() -> None:
    """Give the calling thread one torch (OpenMP) thread: for the control plane's threads,
    so that the runner's compute threads have the cores to themselves.

    OpenMP teams belong to the thread that starts a parallel region, and libgomp stops
    spin-waiting between regions as soon as it manages more threads than there are cores.
    An event loop that once ran a parallel op (the memory plan, say) keeps an idle team, and
    from then on every region of every runner step waits for its workers to be woken
    (measured on 2 cores: 34 ms decode steps instead of 25). The setting is per thread
    (`omp_set_num_threads` on the calling thread; threads started later inherit it, and the
    runner sets its own count on its worker thread)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def bf16_matmul_supported() -> bool:
    """Whether bf16 CPU matmuls run here at all (oneDNN's bf16 path is available)."""
    return cpu_features().onednn_bf16
