"""How long a demotion's copy out of the pool takes on CPU (docs/benchmarks.md, 2026-12-05
second day): `KVCache.read_slots` for 3,300 positions of the KV-heavy random Llama's layout
(16 layers, 8 KV heads of 256, bf16: 412 MiB), against the copy it replaced (index_select,
then a copy to the host, then a concatenation).

    .venv/bin/python docs/results/kv_copy_out.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kernels.kv_cache import COPY_CHUNK, KVCache


def old_read_slots(cache: KVCache, slots: np.ndarray) -> list[torch.Tensor]:
    idx = torch.as_tensor(slots, dtype=torch.int64)
    out = []
    for t in (cache._k[0], cache._v[0]):
        chunks = [
            t.index_select(1, idx[i : i + COPY_CHUNK]).to("cpu", copy=True)
            for i in range(0, idx.numel(), COPY_CHUNK)
        ]
        out.append(torch.cat(chunks, dim=1))
    return out


def main() -> None:
    cache = KVCache(
        num_layers=16,
        num_slots=1100 * 16,
        num_kv_heads=8,
        head_dim=256,
        dtype=torch.bfloat16,
        page_size=16,
    )
    for t in (*cache._k, *cache._v):
        t.normal_()
    slots = np.arange(1600, 1600 + 3300)
    none = np.zeros(0, dtype=np.int64)
    copies = {
        "before": lambda: old_read_slots(cache, slots),
        "now": lambda: cache.read_slots(slots, none),
    }
    for name in ("before", "now", "before", "now"):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            parts = copies[name]()
            times.append(time.perf_counter() - t0)
        mib = sum(p.numel() * p.element_size() for p in parts) / 2**20
        print(f"{name}: {mib:.0f} MiB, best {min(times):.3f} s, median {sorted(times)[2]:.3f} s")
    same = all(torch.equal(a, b) for a, b in zip(copies["before"](), copies["now"]()))
    print("the same bytes:", same)


if __name__ == "__main__":
    main()
