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
