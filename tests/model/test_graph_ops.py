"""`kernels.graph_ops`: the ops a compiled step holds (a packed product by handle, the
K/V write into the pool), eagerly and inside a graph."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels import graph_ops


class _Doubling:
    out_features = 3

    def __init__(self) -> None:
        self.handle = graph_ops.register(self)
        self.calls = 0

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return rows[:, :3] * 2


def test_packed_linear_runs_the_registered_product_eagerly_and_in_a_graph():
    m = _Doubling()
    x = torch.arange(8.0).view(2, 4)
    assert torch.equal(graph_ops.packed_linear(x, m.handle, 3), x[:, :3] * 2)

    @torch.compile(fullgraph=True, backend="inductor")
    def f(rows):
        return graph_ops.product(m, rows) + 1

    assert torch.equal(f(x), x[:, :3] * 2 + 1)
    assert m.calls >= 2  # the graph called the module's own product


def test_a_dropped_module_is_refused_by_name():
    m = _Doubling()
    handle = m.handle
    del m
    gc.collect()
    with pytest.raises(RuntimeError, match=f"packed linear {handle} is gone"):
        graph_ops.packed_linear(torch.ones(1, 4), handle, 3)


def test_write_kv_writes_the_slots_in_place_in_the_pools_dtype():
    pool_k = torch.zeros(16, 1, 4, dtype=torch.bfloat16)
    pool_v = torch.zeros(16, 1, 4, dtype=torch.bfloat16)
    k = torch.randn(2, 1, 4)
    v = torch.randn(2, 1, 4)
    slots = torch.tensor([3, 9])
    graph_ops.write_kv(pool_k, pool_v, slots, k, v)
    assert torch.equal(pool_k[slots], k.bfloat16()) and torch.equal(pool_v[slots], v.bfloat16())
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert not pool_k[others].any() and not pool_v[others].any()


def test_write_kv_in_a_graph_writes_the_pool_itself_not_a_copy():
    pool = torch.zeros(2, 16, 1, 4)  # two layers' K in one tensor: each layer a view
    values = torch.zeros(2, 16, 1, 4)
    ptr = pool.data_ptr()

    @torch.compile(fullgraph=True, backend="inductor")
    def step(k, slots):
        graph_ops.write_kv(pool[1], values[1], slots, k, k + 1)
        return k.sum()

    k = torch.randn(1, 1, 4)
    with torch.inference_mode():
        step(k, torch.tensor([5]))
    assert pool.data_ptr() == ptr
    assert torch.equal(pool[1, 5], k[0]) and torch.equal(values[1, 5], k[0] + 1)
    assert not pool[0].any() and pool[1].count_nonzero() == k.count_nonzero()
