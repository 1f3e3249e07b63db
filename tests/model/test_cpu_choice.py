"""Run-time choices from the CPU: bf16 only where it is native, threads from the cores."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu as cpu
from kernels.cpu import CpuFeatures, choose_dtype, choose_threads, cpu_features

AVX2 = CpuFeatures(
    capability="AVX2",
    flags=frozenset({"avx2", "fma"}),
    native_bf16=False,
    onednn_bf16=False,
    cores=2,
)
AVX512_NO_BF16 = CpuFeatures(
    capability="AVX512", flags=frozenset({"avx512bw"}), native_bf16=False, onednn_bf16=True, cores=4
)
AVX512_BF16 = CpuFeatures(
    capability="AVX512",
    flags=frozenset({"avx512bw", "avx512_bf16"}),
    native_bf16=True,
    onednn_bf16=True,
    cores=8,
)


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (AVX2, torch.float32),
        (AVX512_NO_BF16, torch.float32),
        (AVX512_BF16, torch.bfloat16),
    ],
)
def test_auto_dtype_is_bf16_only_where_it_is_native(monkeypatch, features, expected):
    monkeypatch.setattr(cpu, "cpu_features", lambda: features)
    dtype, reason = choose_dtype("auto")
    assert dtype == expected and reason.startswith("auto:")
    assert features.capability in reason


def test_explicit_dtypes_and_a_bf16_this_cpu_cannot_run(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_features", lambda: AVX2)
    assert choose_dtype("float32") == (torch.float32, "set in the config")
    with pytest.raises(ValueError, match="cannot run on this CPU"):
        choose_dtype("bfloat16")
    with pytest.raises(ValueError, match="dtype must be"):
        choose_dtype("int4")


def test_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "cpu_features", lambda: AVX512_BF16)
    assert choose_threads(3, own_process=False)[0] == 3
    assert choose_threads(0, own_process=True)[0] == 8
    assert choose_threads(0, own_process=False)[0] == 8
    monkeypatch.setattr(
        cpu, "cpu_features", lambda: CpuFeatures("AVX2", frozenset(), False, False, 1)
    )
    assert choose_threads(0, own_process=False)[0] == 1


def test_auto_threads_follow_omp_num_threads(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_features", lambda: AVX512_BF16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(0, own_process=True) == (3, "auto: OMP_NUM_THREADS=3")
    assert choose_threads(5, own_process=True)[0] == 5  # the config wins
    for unusable in ("0", "", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert choose_threads(0, own_process=True)[0] == 8


def test_this_machine_is_described():
    f = cpu_features()
    assert f.cores >= 1 and f.capability
    dtype, reason = choose_dtype("auto")
    assert (dtype == torch.bfloat16) == (f.native_bf16 and f.onednn_bf16), reason


def test_torch_capped_at_avx2_makes_the_engine_choose_as_on_an_avx2_cpu(tmp_path):
    """`ATEN_CPU_CAPABILITY=avx2` (torch's own variable): no AVX-512 or AMX flag counts, so
    `auto` picks fp32 and the Q8_0 kernel builds for AVX2, on any x86 CPU with AVX2."""
    import json
    import os
    import subprocess
    import sys

    if "avx2" not in cpu._cpuinfo_flags():
        pytest.skip("this CPU has no AVX2")
    probe = (
        "import json, torch\n"
        "from kernels.cpu import avx512_disabled, choose_dtype, cpu_features\n"
        "from kernels import q8_0\n"
        "f = cpu_features()\n"
        "lib = q8_0.kernel()\n"
        "print(json.dumps({'capability': f.capability, 'flags': sorted(f.flags),\n"
        "    'native_bf16': f.native_bf16, 'dtype': str(choose_dtype('auto')[0]),\n"
        "    'isa': lib.q8_0_isa() if lib is not None else q8_0.kernel_status(),\n"
        "    'disabled': avx512_disabled()}))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "KVACTOR_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["capability"] == "AVX2"
    assert not [f for f in got["flags"] if f.startswith(("avx512", "amx"))]
    # AVX-NE-CONVERT (an AVX2-class bf16 instruction) still counts where the CPU has it
    native = bool(set(got["flags"]) & set(cpu.NATIVE_BF16_FLAGS))
    assert got["native_bf16"] is native
    if not native:
        assert got["dtype"] == "torch.float32"
    if isinstance(got["isa"], int):
        assert got["isa"] == 1, got  # AVX2, whatever wider the CPU has
    else:  # no kernel here (no compiler, or one that cannot build it): said why
        assert got["isa"].startswith("not built"), got
    assert got["disabled"] == ("avx512f" in cpu._cpuinfo_flags())
