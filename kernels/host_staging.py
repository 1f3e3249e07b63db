"""One host-to-device copy per step for the small index arrays a step needs.

A GPU step needs a dozen small integer arrays on the device (indptrs, lengths, positions,
gather indices). Copied one by one from pageable numpy memory, each `.to(device)` is its
own synchronous transfer: the host waits for the device a dozen times per step, and a
batch-1 decode step's device work is far shorter than those waits.

`HostStaging.to_device(arrays)` packs the arrays into one pinned host buffer (each at an
8-byte-aligned offset), issues one non-blocking copy, and returns device views with the
arrays' dtypes and shapes. Invariant: a pinned buffer is rewritten only after the copy that
last read it has completed (a CUDA event per buffer, polled, never waited on: a busy buffer
is replaced by a fresh one). On the CPU nothing is copied: the views are the arrays
themselves (`pack=True` packs anyway, so the packing is tested where there is no GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

ALIGN = 8


def packed_offsets(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offset of each array in the packed buffer (8-byte aligned), and its total size."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    return offsets, end


class HostStaging:
    """Stages a step's host arrays to `device` in one transfer (see the module doc)."""

    def __init__(self, device: torch.device | str, pack: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pack = self.device.type != "cpu" if pack is None else pack
        self._pin = self.device.type == "cuda"
        self._buffer: Tensor | None = None  # uint8, pinned on CUDA
        self._done: object | None = None  # torch.cuda.Event of the copy that read it
        self.transfers = 0  # packed copies issued (one per call)

    def _host_buffer(self, nbytes: int) -> Tensor:
        buf = self._buffer
        busy = self._done is not None and not self._done.query()
        if buf is None or buf.numel() < nbytes or busy:
            size = max(nbytes, 4096, 0 if buf is None or busy else 2 * buf.numel())
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            self._buffer = buf
        return buf

    def to_device(self, arrays: Sequence[np.ndarray]) -> list[Tensor]:
        """The arrays on the device, with their dtypes and shapes (read-only by contract:
        on the CPU they share memory with the inputs)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.pack:
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = packed_offsets(arrays)
        host = self._host_buffer(total)
        flat = host.numpy()
        for a, off in zip(arrays, offsets):
            flat[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        if self.device.type == "cpu":
            staged = host[:total].clone()
        else:
            staged = host[:total].to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._done = done
        self.transfers += 1
        out = []
        for a, off in zip(arrays, offsets):
            dtype = torch.from_numpy(a[:0]).dtype
            out.append(staged[off : off + a.nbytes].view(dtype).view(a.shape))
        return out
