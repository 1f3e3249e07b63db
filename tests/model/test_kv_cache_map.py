"""The runner's full -> sliding page map follows the allocator's exactly: every freed
sliding page is unmapped on the device too (mapped to the padding page 0), so no stale
mapping points at a sliding page another full page now owns."""

from __future__ import annotations

import numpy as np
import torch

from actors.allocator.actor import pack_deltas
from kernels.kv_cache import KVCache
from kvcore import SwaPages
from tests.unit.ledger_driver import make_ledger, run_sync

PS, WINDOW, PAGES = 4, 16, 32


def test_the_runner_map_forgets_what_the_window_and_releases_freed():
    ledger, _ = make_ledger(PAGES, PS, 4, 256)
    ledger.swa, ledger.window, ledger.swa_free_step = SwaPages(PAGES, PAGES, PS), WINDOW, PS
    kv = KVCache(
        num_layers=2,
        num_slots=(PAGES + 1) * PS,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        sliding_layers=[1],
        swa_num_pages=PAGES,
    )

    def apply(deltas):
        packed = pack_deltas(deltas)
        kv.map_swa(packed.swa_full_pages, packed.swa_pages)
        assert np.array_equal(kv.swa_map.numpy()[: PAGES + 1], ledger.swa.map)

    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 1000, 8)
    deltas = []
    run_sync(ledger.alloc_extend(1, prompt, 64, deltas))
    apply(deltas)
    for _ in range(40):  # decode past the window: sliding pages are freed as it moves
        deltas = []
        assert run_sync(ledger.alloc_decode([1], deltas)) == 0
        apply(deltas)
    assert ledger.counters.swa_freed_pages > 0
    run_sync(ledger.finish(1, np.concatenate([prompt, rng.integers(10, 1000, 41)])))
    ledger.forget(1)
    run_sync(ledger.drop_cache())  # frees every page; the runner hears it with the next reply
    deltas = []
    run_sync(ledger.alloc_extend(2, rng.integers(10, 1000, 6), 64, deltas))
    apply(deltas)
    # A full page that lost its sliding page reads and writes the padding page 0.
    free_full = ledger.pool.free_pages()[:3]
    slots = torch.as_tensor(free_full * PS + 1)
    assert (kv.sliding_slots(slots) == 1).all()
