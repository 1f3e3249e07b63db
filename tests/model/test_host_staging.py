"""The packed host-to-device staging: every array comes back equal, with its dtype and
shape, from one transfer (packed on the CPU here; the GPU adds only pinning and the copy)."""

from __future__ import annotations

import numpy as np
import torch

from kernels.host_staging import HostStaging, packed_offsets


def test_offsets_are_aligned_and_cover_every_array():
    dtypes = [(3, np.int32), (0, np.int64), (5, np.int64), (1, bool)]
    arrays = [np.zeros(n, dtype) for n, dtype in dtypes]
    offsets, total = packed_offsets(arrays)
    assert offsets == [0, 16, 16, 56]
    assert total == 64 and all(o % 8 == 0 for o in offsets)


def test_packed_arrays_come_back_equal_in_one_transfer():
    staging = HostStaging("cpu", pack=True)
    rng = np.random.default_rng(0)
    for step in range(4):  # the buffer is reused and grows
        arrays = [
            rng.integers(-5, 1 << 20, size=3 + 50 * step).astype(np.int64),
            rng.integers(0, 100, size=7).astype(np.int32),
            np.zeros(0, np.int64),
            rng.integers(0, 9, size=(2, 3)).astype(np.int32),
        ]
        out = staging.to_device(arrays)
        assert staging.transfers == step + 1
        for a, t in zip(arrays, out):
            assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
            assert np.array_equal(t.numpy(), a)
        arrays[0][:] = 0  # the staged copy is the device's own, not a view of the input
        assert out[0].abs().sum() > 0


def test_on_the_cpu_without_packing_nothing_is_copied():
    staging = HostStaging("cpu")
    a = np.arange(4, dtype=np.int64)
    (t,) = staging.to_device([a])
    assert staging.transfers == 0 and t.data_ptr() == a.ctypes.data
