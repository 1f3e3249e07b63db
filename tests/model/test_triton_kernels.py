"""The Triton kernels and attention backend against the torch code they replace.

Without CUDA the kernels run under Triton's interpreter on CPU tensors. `triton.jit` reads
TRITON_INTERPRET each time it decorates a function. `kernels.triton_ops` decorates its
kernels on first launch (per value of the setting), so importing it early does no harm;
but triton.language decorates its own helpers (tl.zeros, tl.max, tl.sum, ...) when it is
first imported, and an interpreted kernel cannot call compiled-mode helpers ("Cannot call
@triton.jit'd outside of the scope of a kernel"). So the variable is set here before
anything imports triton (pytest imports every test module before running any test, and no
module collected before this one imports triton today), and the autouse fixture swaps in
interpreted copies of those helpers, for the test's duration, if triton.language was
imported earlier all the same. `test_kernels_run_interpreted` checks the kernels really are
interpreted. With CUDA the tests run the compiled kernels on the GPU instead.

Covered: `store_kv` vs `KVCache.write`, `apply_slot_deltas` vs the host table's, the device
page lists vs `AttentionMetadata.paged_kv` (and mapped to the sliding pool), and the backend
vs `TorchRefBackend` on ragged batches (decode tokens, chunks over cached prefixes, fresh
prompts) with page sizes 1 and 16, GQA, a sliding window shorter than the sequences, logit
soft-capping, split-KV decode and a split sliding-window KV pool.
"""

from __future__ import annotations

import os

import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kernels.attention.base import AttentionMetadata, AttentionShape  # noqa: E402
from kernels.attention.torch_ref import TorchRefBackend  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kernels.forward_batch import ForwardBatch  # noqa: E402
from kernels.kv_cache import KVCache, ReqToTokenTable  # noqa: E402
from kernels.triton_ops.decode import decode_attention  # noqa: E402
from kernels.triton_ops.kv import apply_slot_deltas, paged_kv_indices, store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW = 8
# Mixed batch: a chunk over a cached prefix, a decode token, a fresh prompt longer than the
# window, a decode token far past the window.
PREFIX_LENS = [9, 14, 0, 27]
EXTEND_LENS = [5, 1, 11, 1]
CAPACITY = 32
# Small blocks so that tiny shapes still take several key blocks, query blocks and splits.
SMALL = dict(block_n=16, block_rows=16, kv_split_tokens=8, min_programs=64)


@pytest.fixture(autouse=True)
def _interpret_without_cuda(monkeypatch):
    """Keep the setting for every test even if something reset it meanwhile, and repair
    triton.language if it was imported before the setting (see the module docstring)."""
    if DEVICE != "cpu":
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, InterpretedFunction] = {}  # one copy per function: identity counts
    for module in (tl, tl.core, tl.math, tl.standard):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in interpreted:
                    interpreted[id(value)] = InterpretedFunction(value.fn)
                monkeypatch.setattr(module, name, interpreted[id(value)])


def test_kernels_run_interpreted():
    if DEVICE != "cpu":
        pytest.skip("compiled on CUDA")
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.triton_ops.decode import _decode_kernel
    from kernels.triton_ops.kv import _store_kv_kernel

    k_cache, v_cache = torch.zeros(4, 1, 16), torch.zeros(4, 1, 16)
    store_kv(k_cache, v_cache, torch.tensor([2]), torch.ones(1, 1, 16), torch.ones(1, 1, 16))
    assert torch.equal(k_cache[2], torch.ones(1, 16)) and torch.equal(v_cache[2], torch.ones(1, 16))
    assert isinstance(_store_kv_kernel.jitted(), InterpretedFunction)
    assert isinstance(_decode_kernel.jitted(), InterpretedFunction)


# ---------------------------------------------------------------------------------------------
# store_kv, apply_slot_deltas, paged_kv_indices
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_cache_write(dtype):
    torch.manual_seed(0)
    heads, dim, tokens = 3, 24, 7  # neither a power of two
    ref = KVCache(1, 64, heads, dim, dtype=dtype, device=DEVICE)
    ours = KVCache(1, 64, heads, dim, dtype=dtype, device=DEVICE)
    slots = (torch.randperm(60)[:tokens] + 4).to(DEVICE)
    # k as a strided view (every other head of a wider tensor), v contiguous; both float32
    k = torch.randn(tokens, 2 * heads, dim, device=DEVICE)[:, ::2]
    v = torch.randn(tokens, heads, dim, device=DEVICE)
    ref.write(0, slots, k, v)
    store_kv(*ours.layer_kv(0), slots, k, v)
    for want, got in zip(ref.layer_kv(0), ours.layer_kv(0)):
        assert got.dtype == dtype
        assert torch.equal(got, want)


def test_apply_slot_deltas_matches_table():
    rng = np.random.default_rng(0)

    def dev(a, dtype=torch.int64):
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=DEVICE)

    ref = ReqToTokenTable(6, 300, device=DEVICE)
    ours = ReqToTokenTable(6, 300, device=DEVICE)
    for rows, starts, lengths in [
        ([4, 0, 2], [0, 0, 0], [300, 17, 1]),  # a run longer than the kernel's block
        ([0, 5, 2, 3], [17, 250, 1, 40], [3, 50, 0, 129]),  # an empty run
    ]:
        flat = rng.integers(16, 10_000, size=sum(lengths))
        ref.apply_slot_deltas(rows, starts, lengths, flat)
        apply_slot_deltas(
            ours.table, dev(rows), dev(starts, torch.int32), dev(lengths), dev(flat), validate=True
        )
        assert torch.equal(ours.table, ref.table)
    with pytest.raises(ValueError, match="total length"):
        apply_slot_deltas(ours.table, dev([1]), dev([0]), dev([3]), dev([1, 2]), validate=True)


# ---------------------------------------------------------------------------------------------
# A ragged batch over a scrambled req-to-token table
# ---------------------------------------------------------------------------------------------
class Scenario:
    """Two layers (0 full, 1 sliding) over a batch of `PREFIX_LENS`/`EXTEND_LENS`; rows take
    their pages in scrambled order. With `split`, layer 1 keeps its KV in a sliding pool whose
    pages are scrambled too; pages no query's window reaches map to page 0 (freed)."""

    def __init__(
        self, page, heads, kv_heads, dim, softcap, split, seed=0, prefix=None, dtype=torch.float32
    ):
        gen = torch.Generator().manual_seed(seed)
        self.prefix = list(PREFIX_LENS if prefix is None else prefix)
        self.extend = list(EXTEND_LENS)
        rows = len(self.prefix)
        self.shape = AttentionShape(heads, kv_heads, dim, dim**-0.5, softcap, WINDOW)
        num_pages = rows * CAPACITY // page
        cache_args = dict(
            num_layers=2,
            num_slots=(num_pages + 1) * page,
            num_kv_heads=kv_heads,
            head_dim=dim,
            device=DEVICE,
            dtype=dtype,
            page_size=page,
        )
        if split:
            cache_args.update(sliding_layers=(1,), swa_num_pages=num_pages)
        self.caches = [KVCache(**cache_args), KVCache(**cache_args)]  # reference, ours
        self.table = ReqToTokenTable(rows, CAPACITY, device=DEVICE)
        pages = torch.randperm(num_pages, generator=gen) + 1
        self.flat = (pages[:, None] * page + torch.arange(page)).reshape(rows, CAPACITY)
        self.table.apply_slot_deltas(
            list(range(rows)), [0] * rows, [CAPACITY] * rows, self.flat.reshape(-1)
        )
        if split:
            swa = torch.randperm(num_pages, generator=gen) + 1
            full_pages, swa_pages = [], []
            for r, (p, e) in enumerate(zip(self.prefix, self.extend)):
                needed_from = max(0, p - WINDOW + 1)  # the first new token's window
                for j in range(CAPACITY // page):
                    full_pages.append(int(self.flat[r, j * page]) // page)
                    reached = (j + 1) * page > needed_from
                    swa_pages.append(int(swa[full_pages[-1] - 1]) if reached else 0)
            for cache in self.caches:
                cache.map_swa(full_pages, swa_pages)
        # Keys and values of every position of every request, per layer.
        seqs = [p + e for p, e in zip(self.prefix, self.extend)]

        def randn(*size):
            return torch.randn(*size, generator=gen).to(dtype)

        self.k = [[randn(s, kv_heads, dim) for s in seqs] for _ in range(2)]
        self.v = [[randn(s, kv_heads, dim) for s in seqs] for _ in range(2)]
        for layer in range(2):
            for r, p in enumerate(self.prefix):
                if p:
                    slots = self.table.table[r, :p].long()
                    for cache in self.caches:
                        cache.write(
                            layer,
                            slots,
                            self.k[layer][r][:p].to(DEVICE),
                            self.v[layer][r][:p].to(DEVICE),
                        )
        self.q = [randn(sum(self.extend), heads, dim) for _ in range(2)]
        batch = ForwardBatch(
            list(range(rows)), self.prefix, [[0] * e for e in self.extend], [True] * rows
        )
        self.meta = AttentionMetadata.build(batch, self.table, self.caches[1], self.shape)

    def new_kv(self, layer):
        ks = torch.cat([k[p:] for k, p in zip(self.k[layer], self.prefix)])
        vs = torch.cat([v[p:] for v, p in zip(self.v[layer], self.prefix)])
        return ks.to(DEVICE), vs.to(DEVICE)

    def run(self, backend, cache):
        backend.plan(self.meta)
        outs = []
        for layer in range(2):
            k, v = self.new_kv(layer)
            q = self.q[layer].to(DEVICE)
            outs.append(backend.forward(layer, q, k, v, cache, is_sliding=layer == 1))
        return outs

    def check(self, backend, rtol=1e-4, atol=1e-5):
        want = self.run(TorchRefBackend(), self.caches[0])
        got = self.run(backend, self.caches[1])
        for layer in range(2):
            torch.testing.assert_close(got[layer], want[layer], rtol=rtol, atol=atol)
            for ref_t, our_t in zip(self.caches[0].layer_kv(layer), self.caches[1].layer_kv(layer)):
                assert torch.equal(our_t, ref_t)


@pytest.mark.parametrize("page", [1, 16])
def test_paged_kv_indices_match_metadata(page):
    sc = Scenario(page, 4, 2, 16, None, split=True)
    meta = sc.meta
    rows = torch.arange(meta.batch_size, dtype=torch.int64, device=DEVICE)
    want = meta.paged_kv
    indptr, indices, last = paged_kv_indices(sc.table.table, rows, meta.seq_lens, page)
    assert torch.equal(indptr, want.kv_page_indptr)
    assert torch.equal(indices, want.kv_page_indices)
    assert torch.equal(last, want.kv_last_page_len)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    swa_map = sc.caches[1].swa_map
    _, mapped, _ = paged_kv_indices(
        sc.table.table, rows, meta.seq_lens, page, page_map=swa_map, num_pages=int(indptr[-1])
    )
    assert torch.equal(mapped, swa_map[want.kv_page_indices.long()].int())
    assert (mapped != 0).any() and (mapped == 0).any()  # some pages mapped, some freed


# ---------------------------------------------------------------------------------------------
# The backend against the reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 16), (4, 2, 32)])
@pytest.mark.parametrize("page", [1, 16])
def test_backend_matches_torch_ref(page, heads, kv_heads, dim, softcap):
    Scenario(page, heads, kv_heads, dim, softcap, split=False).check(
        TritonAttentionBackend(**SMALL)
    )


@pytest.mark.parametrize("use_pages", [False, True])
@pytest.mark.parametrize("page", [1, 16])
def test_backend_split_sliding_pool(page, use_pages):
    sc = Scenario(page, 4, 2, 16, 5.0, split=True, seed=1)
    assert sc.caches[1].split and sc.meta.sliding_slots is not None
    # With the options the runner gives every GPU backend.
    options = dict(device=DEVICE, dtype=torch.float32, graph_max_pages=0)
    sc.check(TritonAttentionBackend(use_pages=use_pages, **options, **SMALL))


def test_backend_page_lists_and_head_dim_not_power_of_two():
    sc = Scenario(16, 6, 2, 24, None, split=False, seed=2)  # group 3, head_dim 24
    sc.check(TritonAttentionBackend(use_pages=True, **SMALL))


def test_backend_float16():
    """float16 K/V, q and output (float32 softmax inside); the interpreter's bfloat16 dot is
    not usable (numpy has no bfloat16), so bfloat16 is left to the GPU."""
    sc = Scenario(16, 4, 2, 32, 5.0, split=True, seed=4, dtype=torch.float16)
    sc.check(TritonAttentionBackend(**SMALL), rtol=2e-3, atol=2e-3)


def test_decode_kv_splits_agree():
    """Decode alone, 1 split vs 8 (31 keys: splits of 4; 28 keys: splits of 4, the last empty)."""
    sc = Scenario(1, 4, 2, 16, 5.0, split=False, seed=3, prefix=[20, 30, 0, 27])
    decode = sc.meta.extend_lens_host == 1
    reqs = torch.from_numpy(np.flatnonzero(decode)).int().to(DEVICE)
    rows = torch.from_numpy(sc.meta.qo_indptr_host[:-1][decode]).to(DEVICE)
    k_all, v_all = sc.caches[1].layer_kv(0)
    q = sc.q[0].to(DEVICE)
    outs = []
    for splits in (1, 8):
        out = torch.zeros_like(q)
        decode_attention(
            q, k_all, v_all, out, reqs, rows, sc.meta.seq_lens, sc.meta.kv_indptr,
            sc.meta.kv_indices, scale=sc.shape.scale, softcap=5.0, num_kv_splits=splits,
            block_n=16,
        )  # fmt: skip
        outs.append(out[rows])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert outs[0].abs().sum() > 0
