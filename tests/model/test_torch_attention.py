"""The CPU reference attention's decode grouping: requests of similar context length are
attended together, and a request's output does not depend on the group it lands in."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kernels.attention.base import AttentionMetadata, AttentionShape
from kernels.attention.torch_ref import DECODE_GROUP_COST_LANES, TorchRefBackend, decode_groups
from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import KVCache, ReqToTokenTable


def _cost(lengths: np.ndarray, groups: list[np.ndarray], group_cost: int) -> int:
    return sum(len(g) * int(lengths[g].max()) + group_cost for g in groups)


def _set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


@pytest.mark.parametrize("seed", range(6))
def test_decode_groups_is_an_optimal_partition(seed):
    """Against every partition of up to 7 requests (not only runs of the sorted lengths)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    lengths = rng.integers(1, 900, n)
    group_cost = int(rng.choice([0, 64, DECODE_GROUP_COST_LANES, 2000]))
    groups = decode_groups(lengths, group_cost)
    assert sorted(itertools.chain.from_iterable(g.tolist() for g in groups)) == list(range(n))
    assert all(g.size and np.all(np.diff(g) > 0) for g in groups)  # ascending, non-empty
    best = min(
        _cost(lengths, [np.array(p) for p in part], group_cost)
        for part in _set_partitions(list(range(n)))
    )
    assert _cost(lengths, groups, group_cost) == best


def test_decode_groups_keeps_similar_lengths_together():
    assert [g.tolist() for g in decode_groups(np.array([200] * 32))] == [list(range(32))]
    assert [g.tolist() for g in decode_groups(np.array([7]))] == [[0]]
    # Two clusters far apart: padding the short ones to 600 would cost far more than a group.
    lengths = np.array([600, 20, 598, 25, 590, 22])
    assert sorted(g.tolist() for g in decode_groups(lengths)) == [[0, 2, 4], [1, 3, 5]]


def _decode_batch(lengths: list[int], window: int | None, seed: int = 0):
    """One decode token per request over `lengths - 1` cached keys in scrambled pages."""
    gen = torch.Generator().manual_seed(seed)
    page, heads, kv_heads, dim = 4, 4, 1, 16
    capacity = -(-max(lengths) // page) * page
    rows = len(lengths)
    num_pages = rows * capacity // page
    cache = KVCache(2, (num_pages + 1) * page, kv_heads, dim, page_size=page)
    table = ReqToTokenTable(rows, capacity)
    pages = torch.randperm(num_pages, generator=gen) + 1
    flat = (pages[:, None] * page + torch.arange(page)).reshape(rows, capacity)
    table.apply_slot_deltas(list(range(rows)), [0] * rows, [capacity] * rows, flat.reshape(-1))
    for layer in range(2):
        for r, n in enumerate(lengths):
            slots = table.table[r, : n - 1].long()
            cache.write(
                layer,
                slots,
                torch.randn(n - 1, kv_heads, dim, generator=gen),
                torch.randn(n - 1, kv_heads, dim, generator=gen),
            )
    shape = AttentionShape(heads, kv_heads, dim, dim**-0.5, None, window)
    q = torch.randn(rows, heads, dim, generator=gen)
    k = torch.randn(rows, kv_heads, dim, generator=gen)
    v = torch.randn(rows, kv_heads, dim, generator=gen)
    return cache, table, shape, q, k, v


def _attend(cache, table, shape, q, k, v, rows: list[int], lengths: list[int]):
    batch = ForwardBatch.decode(rows, [lengths[r] - 1 for r in rows], [0] * len(rows))
    backend = TorchRefBackend()
    backend.plan(AttentionMetadata.build(batch, table, cache, shape))
    index = torch.tensor(rows)
    return [
        backend.forward(layer, q[index], k[index], v[index], cache, is_sliding=layer == 1)
        for layer in range(2)
    ]


@pytest.mark.parametrize("window", [None, 64])
def test_grouped_decode_matches_each_request_alone(window):
    lengths = [3, 700, 40, 41, 698, 9, 300]
    assert len(decode_groups(np.array(lengths))) > 1  # the batch really is split
    cache, table, shape, q, k, v = _decode_batch(lengths, window)
    together = _attend(cache, table, shape, q, k, v, list(range(len(lengths))), lengths)
    for r in range(len(lengths)):
        alone = _attend(cache, table, shape, q, k, v, [r], lengths)
        for layer in range(2):
            torch.testing.assert_close(together[layer][r], alone[layer][0], rtol=1e-5, atol=1e-6)
