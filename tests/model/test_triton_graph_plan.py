"""The Triton backend's CUDA-graph plan (`plan_graph`) against its eager plan, on the CPU.

A decode-only step of n requests padded to a bucket of 8, with lengths on both sides of the
sliding window, page sizes 1 and 16, one KV pool or a split sliding pool: the graph plan's
outputs for the n requests match the eager plan's, the K/V it writes match outside page 0
(the padding page, the only place padding requests write), a second step into the bucket
reuses the same buffers, and planning reads nothing back from the device. Capturing and
replaying the graphs (`DecodeGraphs`) needs CUDA and is not covered here.
"""

from __future__ import annotations

import os

import torch  # does not import triton

if not torch.cuda.is_available():  # before triton is imported: see test_triton_kernels
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels.attention.base import AttentionMetadata, AttentionShape  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kernels.cuda_graphs import graph_max_pages  # noqa: E402
from kernels.forward_batch import ForwardBatch  # noqa: E402
from kernels.kv_cache import KVCache, ReqToTokenTable  # noqa: E402

# The interpreter set-up fixture (autouse), shared with the kernel tests.
from tests.model.test_triton_kernels import DEVICE, SMALL, _interpret_without_cuda  # noqa: E402,F401

WINDOW, CAPACITY, BUCKET, HEADS, KV_HEADS, DIM = 8, 64, 8, 4, 2, 16
# Two decode steps into the same bucket: (request rows, their prefix lengths).
STEPS = [([0, 1, 2, 3, 4], [3, 20, 40, 9, 13]), ([4, 1, 3], [14, 21, 10])]


def make_caches(page: int, split: bool):
    """Two identical KV caches (eager, graph) full of random K/V, rows over scrambled pages
    (and a scrambled sliding-pool map for `split`), and the req-to-token table."""
    gen = torch.Generator().manual_seed(page + split)
    rows = 5
    num_pages = rows * CAPACITY // page
    args = dict(
        num_layers=2,
        num_slots=(num_pages + 1) * page,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        page_size=page,
        device=DEVICE,
        sliding_layers=[1] if split else [],
        swa_num_pages=num_pages if split else 0,
    )
    caches = [KVCache(**args), KVCache(**args)]
    if split:
        swa = (torch.randperm(num_pages, generator=gen) + 1).tolist()
        for cache in caches:
            cache.map_swa(list(range(1, num_pages + 1)), swa)
    for layer in range(2):
        for t in caches[0].layer_kv(layer):
            t.copy_(torch.randn(t.shape, generator=gen))
        for ref, t in zip(caches[0].layer_kv(layer), caches[1].layer_kv(layer)):
            t.copy_(ref)
    table = ReqToTokenTable(rows, CAPACITY, device=DEVICE)
    pages = torch.randperm(num_pages, generator=gen) + 1
    flat = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    table.apply_slot_deltas(list(range(rows)), [0] * rows, [CAPACITY] * rows, flat)
    return caches, table


def step_meta(rows, prefix_lens, table, cache) -> AttentionMetadata:
    shape = AttentionShape(HEADS, KV_HEADS, DIM, DIM**-0.5, 5.0, WINDOW)
    batch = ForwardBatch(rows, prefix_lens, [[0]] * len(rows), [True] * len(rows))
    return AttentionMetadata.build(batch, table, cache, shape)


def run(backend, cache, qkv):
    """`forward` of both layers (0 full, 1 sliding) after the backend's plan."""
    return [backend.forward(layer, *qkv[layer], cache, is_sliding=layer == 1) for layer in range(2)]


def graph_buffers(backend) -> list[int]:
    p = backend._plan
    tensors = [p.decode_reqs, p.decode_rows, p.seq_lens, p.out_slots, p.sliding_out_slots]
    tensors += [p.full.loc_indptr, p.full.kv_loc, p.sliding.loc_indptr, p.sliding.kv_loc]
    return [t.data_ptr() for t in tensors if t is not None]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("page", [1, 16])
def test_graph_plan_matches_the_eager_plan(page, split):
    caches, table = make_caches(page, split)
    eager = TritonAttentionBackend(**SMALL)
    graph = TritonAttentionBackend(graph_max_pages=graph_max_pages(CAPACITY, page), **SMALL)
    gen = torch.Generator().manual_seed(7)
    pointers = []
    for rows, prefix_lens in STEPS:
        n = len(rows)
        metas = [step_meta(rows, prefix_lens, table, cache) for cache in caches]
        qkv = [
            [
                torch.randn(BUCKET, h, DIM, generator=gen).to(DEVICE)
                for h in (HEADS, KV_HEADS, KV_HEADS)
            ]
            for _ in range(2)
        ]
        eager.plan(metas[0])
        want = run(eager, caches[0], [[t[:n] for t in layer] for layer in qkv])
        graph.plan_graph(metas[1], BUCKET)
        got = run(graph, caches[1], qkv)  # padded to the bucket
        pointers.append(graph_buffers(graph))
        assert graph._plan.full.num_kv_splits > 1  # fixed per bucket, from the row capacity
        for layer in range(2):
            assert got[layer].shape == (BUCKET, HEADS, DIM)
            torch.testing.assert_close(got[layer][:n], want[layer], rtol=1e-4, atol=1e-5)
            for ref, ours in zip(caches[0].layer_kv(layer), caches[1].layer_kv(layer)):
                # Padding wrote page 0 only; the requests' slots got the same K/V.
                assert torch.equal(ours[page:], ref[page:])
                assert not torch.equal(ours[:page], ref[:page])
                ours[:page] = ref[:page]
        slots = metas[0].out_slots
        k_full, v_full = caches[1].layer_kv(0)
        assert torch.equal(k_full[slots], qkv[0][1][:n]) and torch.equal(
            v_full[slots], qkv[0][2][:n]
        )
    assert pointers[0] == pointers[1]  # the second step reused the bucket's buffers


def test_graph_plan_reads_nothing_back_from_the_device(monkeypatch):
    caches, table = make_caches(16, split=True)
    meta = step_meta(*STEPS[0], table, caches[1])
    meta.paged_kv  # built by the metadata (not the backend's plan), before the guard
    backend = TritonAttentionBackend(graph_max_pages=graph_max_pages(CAPACITY, 16), **SMALL)

    def sync(*_):
        raise AssertionError("a device-to-host read while planning a graph step")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    backend.plan_graph(meta, BUCKET)
    monkeypatch.undo()
    assert backend._plan.seq_lens.tolist()[:6] == [4, 21, 41, 10, 14, 1]


def test_graph_plan_refusals():
    caches, table = make_caches(16, split=False)
    meta = step_meta(*STEPS[0], table, caches[1])
    with pytest.raises(RuntimeError, match="without CUDA-graph buffers"):
        TritonAttentionBackend().plan_graph(meta, BUCKET)
    backend = TritonAttentionBackend(graph_max_pages=graph_max_pages(CAPACITY, 16))
    with pytest.raises(ValueError, match="do not fit"):
        backend.plan_graph(meta, 4)
    prefill = AttentionMetadata.build(
        ForwardBatch([0], [3], [[0, 0]], [True]), table, caches[1], meta.shape
    )
    with pytest.raises(ValueError, match="one token per request"):
        backend.plan_graph(prefill, BUCKET)
