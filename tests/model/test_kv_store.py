"""The host tier's store over a real paged KV cache: saved KV comes back bit for bit at the
slots a load names, full and sliding layers alike; bad loads change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.kv_cache import KVCache
from kernels.kv_store import CorruptKv, HostKvStore, MissingKv

PS = 4


def filled_cache(dtype=torch.bfloat16) -> KVCache:
    cache = KVCache(
        num_layers=6,
        num_slots=33 * PS,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        page_size=PS,
        sliding_layers=[0, 1, 2, 4, 5],
        swa_num_pages=16,
    )
    gen = torch.Generator().manual_seed(0)
    for t in (*cache._k, *cache._v):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return cache


def kv_at(cache: KVCache, layer: int, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = cache.layer_kv(layer)
    idx = torch.as_tensor(slots, dtype=torch.int64)
    return k[idx].clone(), v[idx].clone()


def test_saved_kv_loads_back_bit_for_bit_at_other_slots():
    cache = filled_cache()
    store = HostKvStore(cache)
    full = np.arange(2 * PS, 7 * PS)  # positions [0, 20) on pages 2..6
    swa = np.arange(9 * PS, 11 * PS)  # the sliding KV of positions [12, 20)
    before_full = kv_at(cache, 3, full)
    before_swa = kv_at(cache, 0, swa)
    nbytes = store.save(7, full, swa)
    # full layer: 2 x 20 x 2 x 8; sliding layers: 5 x 2 x 8 x 2 x 8, bf16
    assert nbytes == 2 * (2 * 20 * 2 * 8 + 5 * 2 * 8 * 2 * 8)
    assert store.sizes() == {7: ("host", nbytes)}
    # Load positions [8, 20) to pages 20..22 and sliding entries 4..7 ([16, 20)) to page 14.
    dst_full = np.arange(20 * PS, 23 * PS)
    dst_swa = np.arange(14 * PS, 15 * PS)
    store.load(7, 8, dst_full, np.arange(4, 8), dst_swa)
    k, v = kv_at(cache, 3, dst_full)
    assert torch.equal(k, before_full[0][8:]) and torch.equal(v, before_full[1][8:])
    k, v = kv_at(cache, 0, dst_swa)
    assert torch.equal(k, before_swa[0][4:]) and torch.equal(v, before_swa[1][4:])
    assert store.drop([7, 99]) == nbytes and store.sizes() == {}


def test_one_pool_stores_full_slots_only():
    cache = KVCache(num_layers=2, num_slots=9 * PS, num_kv_heads=1, head_dim=4, page_size=PS)
    cache._k[0].normal_()
    store = HostKvStore(cache)
    slots = np.arange(PS, 3 * PS)
    want = kv_at(cache, 1, slots)[0]
    store.save(1, slots, np.zeros(0, dtype=np.int64))
    store.load(1, 0, np.arange(5 * PS, 7 * PS), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert torch.equal(kv_at(cache, 1, np.arange(5 * PS, 7 * PS))[0], want)


def test_bad_loads_are_refused_and_write_nothing():
    cache = filled_cache(torch.float32)
    store = HostKvStore(cache)
    store.save(1, np.arange(PS, 3 * PS), np.arange(PS, 2 * PS))
    snapshot = [t.clone() for t in (*cache._k, *cache._v)]
    with pytest.raises(MissingKv):
        store.load(2, 0, np.arange(PS), np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="outside"):
        store.load(1, 4, np.arange(5 * PS, 7 * PS), np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="sliding entries outside"):
        store.load(1, 0, np.arange(5 * PS, 6 * PS), np.arange(3, 5), np.arange(2))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (*cache._k, *cache._v)))


def spilled(tmp_path, fingerprint="model-a"):
    cache = filled_cache()
    store = HostKvStore(cache, tmp_path / "tier", fingerprint)
    full, swa = np.arange(2 * PS, 7 * PS), np.arange(9 * PS, 11 * PS)
    want = (kv_at(cache, 3, full), kv_at(cache, 1, swa))
    host_bytes = store.save(4, full, swa)
    return cache, store, want, host_bytes


def test_a_spilled_entry_is_a_file_that_loads_back_bit_for_bit(tmp_path):
    cache, store, want, host_bytes = spilled(tmp_path)
    nbytes = store.spill(4)
    path = tmp_path / "tier" / "4.kv"
    assert path.stat().st_size == nbytes >= host_bytes  # the tensors and a small header
    assert store.entries == {} and store.sizes() == {4: ("disk", nbytes)}
    dst_full, dst_swa = np.arange(20 * PS, 25 * PS), np.arange(14 * PS, 16 * PS)
    store.load(4, 0, dst_full, np.arange(8), dst_swa)
    assert all(torch.equal(a, b) for a, b in zip(kv_at(cache, 3, dst_full), want[0]))
    assert all(torch.equal(a, b) for a, b in zip(kv_at(cache, 1, dst_swa), want[1]))
    store.drop([4])
    assert not path.exists() and store.sizes() == {}
    store.close()
    assert not (tmp_path / "tier").exists()


def test_a_file_written_beside_is_the_entry_only_once_committed(tmp_path):
    """The three steps of a spill written on another thread: until the commit the entry is
    a host entry (its load reads memory); an entry dropped meanwhile leaves no file."""
    cache, store, want, host_bytes = spilled(tmp_path)
    entry = store.spill_source(4)
    partial = store.write_partial(4, entry)
    assert partial.exists() and store.sizes() == {4: ("host", host_bytes)}
    dst_full = np.arange(20 * PS, 25 * PS)
    store.load(4, 0, dst_full, np.arange(0), np.arange(0))
    assert all(torch.equal(a, b) for a, b in zip(kv_at(cache, 3, dst_full), want[0]))
    nbytes = store.commit_spill(4, entry, partial)
    assert store.sizes() == {4: ("disk", nbytes)} and not partial.exists()
    assert store.spill_source(4) is None and store.spill(4) == nbytes  # already a file
    # Dropped while its file is written: the commit refuses and deletes the file.
    store.save(5, np.arange(2 * PS, 4 * PS), np.arange(0))
    entry = store.spill_source(5)
    partial = store.write_partial(5, entry)
    store.drop([5])
    with pytest.raises(MissingKv):
        store.commit_spill(5, entry, partial)
    assert not partial.exists() and sorted(p.name for p in partial.parent.iterdir()) == ["4.kv"]
    with pytest.raises(MissingKv):
        store.spill_source(5)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "other model"])
def test_a_damaged_or_foreign_file_is_refused_and_writes_nothing(tmp_path, damage):
    cache, store, _, _ = spilled(tmp_path)
    store.spill(4)
    path = tmp_path / "tier" / "4.kv"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF  # one byte of the last tensor
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        path.unlink()
    else:
        store.fingerprint = "model-b"
    before = [t.clone() for t in (*cache._k, *cache._v)]
    with pytest.raises(CorruptKv):
        store.load(4, 0, np.arange(20 * PS, 25 * PS), np.arange(8), np.arange(14 * PS, 16 * PS))
    assert all(torch.equal(a, b) for a, b in zip(before, (*cache._k, *cache._v)))


def test_a_manifest_keeps_listed_files_for_the_next_store_and_nothing_else(tmp_path):
    cache, store, want, _ = spilled(tmp_path)
    store.spill(4)
    store.save(5, np.arange(PS, 2 * PS), np.zeros(0, np.int64))
    store.spill(5)
    store.write_manifest([{"handle": 4, "session_id": "s"}])
    store.close()  # 5 was not listed: deleted; 4 and the manifest stay
    folder = tmp_path / "tier"
    assert sorted(p.name for p in folder.iterdir()) == ["4.kv", "sessions.json"]
    (folder / "junk.partial").write_bytes(b"x")
    nxt = HostKvStore(cache, folder, "model-a")
    assert nxt.adopt_manifest() == [{"handle": 4, "session_id": "s"}]
    assert nxt.sizes() == {}  # adopted, not the ledger's until claimed
    assert sorted(p.name for p in folder.iterdir()) == ["4.kv"]  # the manifest is consumed
    nxt.claim([4])
    dst = np.arange(20 * PS, 25 * PS)
    nxt.load(4, 0, dst, np.arange(8), np.arange(14 * PS, 16 * PS))
    assert all(torch.equal(a, b) for a, b in zip(kv_at(cache, 3, dst), want[0]))
    nxt.close()  # no manifest this time: the folder goes
    assert not folder.exists()


def test_another_models_manifest_adopts_nothing_and_its_files_go(tmp_path):
    _, store, _, _ = spilled(tmp_path)
    store.spill(4)
    store.write_manifest([{"handle": 4}])
    store.close()
    other = HostKvStore(filled_cache(), tmp_path / "tier", "model-b")
    assert other.adopt_manifest() == []
    assert list((tmp_path / "tier").iterdir()) == []


def test_a_spilled_entry_read_ahead_loads_from_memory_and_goes_with_its_entry(tmp_path):
    cache, store, want, _ = spilled(tmp_path)
    store.spill(4)
    assert store.read_spilled(99) is None  # not spilled: nothing to read
    copy = store.read_spilled(4)  # touches no state: any thread may run it
    assert copy is not None and store.staged == {}
    assert not store.put_staged(4, (copy[0], (0, 0, 0)))  # read from another file: refused
    assert store.put_staged(4, copy) and store.sizes() == {4: ("disk", store.on_disk[4])}
    (tmp_path / "tier" / "4.kv").unlink()  # the load reads nothing more from disk
    dst_full, dst_swa = np.arange(20 * PS, 25 * PS), np.arange(14 * PS, 16 * PS)
    store.load(4, 0, dst_full, np.arange(8), dst_swa)
    assert all(torch.equal(a, b) for a, b in zip(kv_at(cache, 3, dst_full), want[0]))
    assert all(torch.equal(a, b) for a, b in zip(kv_at(cache, 1, dst_swa), want[1]))
    assert store.staged == {}  # taken by the load
    store.drop([4])
    assert not store.put_staged(4, copy)  # dropped meanwhile: the copy is not kept


def test_read_ahead_copies_are_bounded_dropped_with_their_entry_and_verified(tmp_path):
    from kernels.kv_store import MAX_STAGED

    cache, store, _, _ = spilled(tmp_path)
    for h in range(10, 10 + MAX_STAGED + 1):
        store.save(h, np.arange(2 * PS, 4 * PS), np.arange(9 * PS, 10 * PS))
        store.spill(h)
        stored = store.put_staged(h, store.read_spilled(h))
        assert stored == (h < 10 + MAX_STAGED)  # full: refused, none waiting is pushed out
    assert list(store.staged) == list(range(10, 10 + MAX_STAGED))
    store.drop([11])
    assert 11 not in store.staged
    path = tmp_path / "tier" / "12.kv"
    store.staged.clear()
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.read_spilled(12) is None  # a damaged file is not read ahead (the load fails)
    store.save(5, np.arange(2 * PS, 4 * PS), np.arange(9 * PS, 10 * PS))
    assert not store.put_staged(5, (store.entries[5], (0, 0, 0)))  # a host entry: no read-ahead


def test_the_checksum_is_the_one_earlier_files_carry():
    """Hashing the tensors in place gives what hashing their bytes' copies gave (the
    format of files a drain left for the next start)."""
    import hashlib

    from kernels.kv_store import _checksum

    gen = torch.Generator().manual_seed(1)
    tensors = {
        "part0": torch.randn(3, 5, 2, 4, generator=gen).to(torch.bfloat16),
        "part1": torch.randn(3, 5, 2, 4, generator=gen).to(torch.bfloat16)[:, 1:],  # a view
        "part2": torch.zeros(0, 4),
    }
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    assert _checksum(tensors) == digest.hexdigest()
