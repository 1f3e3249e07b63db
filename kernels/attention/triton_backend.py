"""The Triton attention backend: paged attention with the kernels of `kernels.triton_ops`.

`plan` (once per forward) splits the batch into decode requests (one new token: the
split-KV decode kernel) and extend requests (a chunk of new tokens over a cached prefix:
the extend kernel, cut into blocks of new tokens), and prepares per layer kind the key
locations the kernels read: for full layers the metadata's slots (`kv_indices`, or its page
lists with `use_pages`), for sliding layers the same mapped into the sliding pool when the
KV cache has one (`meta.sliding_slots`), read only from the window on. `forward` (once per
layer) stores the new K/V with `store_kv` at `meta.out_slots`, mapped to the sliding pool's
slots for the cache's sliding layers (as `KVCache.write` does), then runs the kernels into
one [T, Hq, D] output.

Semantics are those of the reference backend (`torch_ref`): causal, sliding window on
sliding layers (keys at positions > q - window), logit soft-capping, query head h reading KV
head h // group_size. The kernels run compiled on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1` (tests).

`plan_graph(meta, bucket)` plans a decode step padded to `bucket` requests for a CUDA graph
(`kernels.cuda_graphs`): it copies the step into that bucket's fixed device buffers (page
lists, lengths, output slots), and `forward` then reads only those, with launch grids fixed
per bucket (the bucket's requests x KV heads x a per-bucket split count). Padding requests
have one key, in the reserved page 0, and write their K/V at slot 0. Both plans send their
host arrays to the device in one staged, non-blocking copy (`kernels.host_staging`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)
from kernels.host_staging import HostStaging
from kernels.kv_cache import KVCache
from kernels.triton_ops.decode import decode_attention
from kernels.triton_ops.extend import extend_attention, extend_block_m, extend_work_items
from kernels.triton_ops.kv import store_kv


@dataclass(frozen=True)
class _KeyLayout:
    """Where one layer kind's kernels find each request's keys."""

    loc_indptr: Tensor  # int32 [B + 1] into kv_loc
    kv_loc: Tensor  # slots (page_size 1) or page ids
    page_size: int
    window: int | None
    num_kv_splits: int  # for the decode requests


@dataclass(frozen=True)
class _Plan:
    """Every tensor `forward` reads (besides q/k/v and the KV cache)."""

    meta: AttentionMetadata
    decode_reqs: Tensor  # int32 [Bd]: requests with one new token
    decode_rows: Tensor  # int64 [Bd]: their q row
    seq_lens: Tensor  # int32 [B]
    item_reqs: Tensor  # int32 [W]: extend work items (request, first new token)
    item_starts: Tensor  # int32 [W]
    block_m: int
    full: _KeyLayout
    sliding: _KeyLayout
    out_slots: Tensor  # int64 [T]
    sliding_out_slots: Tensor | None  # out_slots in the sliding pool (split caches)


@dataclass(frozen=True)
class _GraphBuffers:
    """One bucket's fixed device buffers: a captured graph reads them at these addresses,
    so each graph plan overwrites them in place and never reallocates them."""

    reqs: Tensor  # int32 arange(bucket): a decode-only step's requests ...
    rows: Tensor  # int64 arange(bucket): ... and their q rows
    lens: Tensor  # int32 [2 * bucket + 1]: seq_lens, then loc_indptr (one staged copy)
    kv_loc: Tensor  # int32 page ids, full layers
    sliding_loc: Tensor  # int32 page ids in the sliding pool (split caches)
    out_slots: Tensor  # int64 [bucket]
    sliding_out_slots: Tensor  # int64 [bucket], in the sliding pool (split caches)
    no_items: Tensor  # int32 [0]: no extend work
    full_splits: int  # num_kv_splits of the full layers, fixed per bucket
    sliding_splits: int


def _sliding_loc(meta: AttentionMetadata, loc: Tensor, page: int) -> Tensor:
    """Key locations `loc` (slots for page 1, else page ids) mapped into the sliding pool."""
    if page == 1:
        return meta.sliding_slots(loc)
    return (meta.sliding_slots(loc.long() * page) // page).to(loc.dtype)


@register_attention_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton, planned once per forward.

    Options: `block_n` keys per inner iteration; `block_rows` query rows (new tokens x the
    query heads of one KV head) per extend program; decode requests are split over up to
    `max_kv_splits` programs per (request, KV head), one per `kv_split_tokens` keys, and
    only while the batch has fewer than `min_programs` (request, KV head) pairs;
    `use_pages` reads keys through page ids (FlashInfer's layout) instead of slot lists.
    `device`, `dtype` and `graph_max_pages` are the options the runner gives every GPU
    backend: the first two are recorded only (the kernels follow the tensors they are given);
    `graph_max_pages` (pages the largest bucket's batch may reference; 0: no CUDA graphs)
    sizes the page-id buffers of `plan_graph`, which reads keys through pages whatever
    `use_pages` says.
    """

    name = "triton"

    def __init__(
        self,
        block_n: int = 64,
        block_rows: int = 64,
        max_kv_splits: int = 16,
        kv_split_tokens: int = 512,
        min_programs: int = 512,
        use_pages: bool = False,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        graph_max_pages: int = 0,
    ) -> None:
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        self.block_n = block_n
        self.block_rows = block_rows
        self.max_kv_splits = max_kv_splits
        self.kv_split_tokens = kv_split_tokens
        self.min_programs = min_programs
        self.use_pages = use_pages
        self.graph_max_pages = graph_max_pages
        self._plan: _Plan | None = None
        self._graphs: dict[int, _GraphBuffers] = {}
        self._staging: HostStaging | None = None

    def _stage(self, arrays: list[np.ndarray], device: torch.device) -> list[Tensor]:
        if self._staging is None or self._staging.device != device:
            self._staging = HostStaging(device)
        return self._staging.to_device(arrays)

    def _num_splits(self, keys: int, num_decode: int, num_kv_heads: int) -> int:
        if num_decode == 0 or num_decode * num_kv_heads >= self.min_programs:
            return 1
        by_keys = -(-keys // self.kv_split_tokens)
        by_programs = -(-self.min_programs // (num_decode * num_kv_heads))
        return max(1, min(self.max_kv_splits, by_keys, by_programs))

    def plan(self, meta: AttentionMetadata) -> None:
        device = meta.kv_indices.device
        shape = meta.shape
        extend = meta.extend_lens_host
        decode = np.flatnonzero(extend == 1)
        others = np.flatnonzero(extend > 1)
        block_m = extend_block_m(shape.group_size, self.block_rows)
        item_reqs, item_starts = extend_work_items(others, extend, block_m)

        if self.use_pages:
            paged = meta.paged_kv
            indptr, loc, page = paged.kv_page_indptr, paged.kv_page_indices, meta.page_size
        else:
            indptr, loc, page = meta.kv_indptr, meta.kv_indices, 1
        sliding_loc = loc
        if meta.sliding_slots is not None:  # the sliding layers' own pool
            sliding_loc = _sliding_loc(meta, loc, page)

        max_seq = int(meta.seq_lens_host[decode].max()) if decode.size else 0
        window = shape.sliding_window
        kv_heads = shape.num_kv_heads
        full = _KeyLayout(indptr, loc, page, None, self._num_splits(max_seq, decode.size, kv_heads))
        sliding_keys = max_seq if window is None else min(max_seq, window)
        sliding = _KeyLayout(
            indptr,
            sliding_loc,
            page,
            window,
            self._num_splits(sliding_keys, decode.size, kv_heads),
        )

        decode_reqs, decode_rows, item_reqs, item_starts = self._stage(
            [
                decode.astype(np.int32),
                meta.qo_indptr_host[decode].astype(np.int64),
                item_reqs.astype(np.int32),
                item_starts.astype(np.int32),
            ],
            device,
        )
        self._plan = _Plan(
            meta=meta,
            decode_reqs=decode_reqs,
            decode_rows=decode_rows,
            seq_lens=meta.seq_lens,
            item_reqs=item_reqs,
            item_starts=item_starts,
            block_m=block_m,
            full=full,
            sliding=sliding,
            out_slots=meta.out_slots,
            sliding_out_slots=(
                None if meta.sliding_slots is None else meta.sliding_slots(meta.out_slots)
            ),
        )

    def _graph_buffers(self, meta: AttentionMetadata, bucket: int) -> _GraphBuffers:
        g = self._graphs.get(bucket)
        if g is not None:
            return g
        from kernels.cuda_graphs import graph_request_pages

        device = meta.kv_indices.device
        per_request = graph_request_pages(self.graph_max_pages)
        pages = bucket * per_request

        def zeros(size: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        # Splits from the longest row a graph step may hold, not from this step's lengths:
        # the grid is fixed at capture (a split past a request's keys is empty, weighs 0).
        row_keys = max(1, (per_request - 1) * meta.page_size)
        window = meta.shape.sliding_window
        sliding_keys = row_keys if window is None else min(row_keys, window)
        kv_heads = meta.shape.num_kv_heads
        g = self._graphs[bucket] = _GraphBuffers(
            reqs=torch.arange(bucket, dtype=torch.int32, device=device),
            rows=torch.arange(bucket, dtype=torch.int64, device=device),
            lens=zeros(2 * bucket + 1, torch.int32),
            kv_loc=zeros(pages, torch.int32),
            sliding_loc=zeros(pages if meta.sliding_slots is not None else 0, torch.int32),
            out_slots=zeros(bucket, torch.int64),
            sliding_out_slots=zeros(bucket, torch.int64),
            no_items=zeros(0, torch.int32),
            full_splits=self._num_splits(row_keys, bucket, kv_heads),
            sliding_splits=self._num_splits(sliding_keys, bucket, kv_heads),
        )
        return g

    def plan_graph(self, meta: AttentionMetadata, bucket: int) -> None:
        """Plan a decode step padded to `bucket` into that bucket's fixed buffers (for
        `kernels.cuda_graphs`), without a host-device sync; padding requests read and write
        page 0 only."""
        if not self.graph_max_pages:
            raise RuntimeError("this backend was built without CUDA-graph buffers")
        if not meta.is_decode_only:
            raise ValueError("a graph step adds one token per request")
        n, extra = meta.batch_size, bucket - meta.batch_size
        if extra < 0:
            raise ValueError(f"{n} requests do not fit a bucket of {bucket}")
        g = self._graph_buffers(meta, bucket)
        paged = meta.paged_kv
        used = int(paged.kv_page_indptr_host[-1])
        if used + extra > g.kv_loc.numel():
            raise ValueError(f"{used + extra} pages exceed the bucket's {g.kv_loc.numel()}")

        # Padding request j: seq_len 1, its one page at kv_loc[used + j] (page 0).
        lens = np.empty(2 * bucket + 1, dtype=np.int32)
        lens[:n] = meta.seq_lens_host
        lens[n:bucket] = 1
        lens[bucket : bucket + n + 1] = paged.kv_page_indptr_host
        lens[bucket + n + 1 :] = used + np.arange(1, extra + 1)
        (staged,) = self._stage([lens], g.lens.device)
        g.lens.copy_(staged, non_blocking=True)

        def fill(buf: Tensor, values: Tensor) -> Tensor:
            """buf = values, then zeros (page 0 / slot 0) for the padding."""
            k = values.numel()
            buf[:k].copy_(values, non_blocking=True)
            buf[k : k + extra].zero_()
            return buf

        pages = paged.kv_page_indices
        kv_loc = fill(g.kv_loc, pages)
        out_slots = fill(g.out_slots, meta.out_slots)
        sliding_loc, sliding_out_slots = kv_loc, None
        if meta.sliding_slots is not None:  # page 0 and slot 0 map to themselves
            sliding_loc = fill(g.sliding_loc, _sliding_loc(meta, pages, meta.page_size))
            sliding_out_slots = fill(g.sliding_out_slots, meta.sliding_slots(meta.out_slots))

        seq_lens, indptr = g.lens[:bucket], g.lens[bucket:]
        page, window = meta.page_size, meta.shape.sliding_window
        self._plan = _Plan(
            meta=meta,
            decode_reqs=g.reqs,
            decode_rows=g.rows,
            seq_lens=seq_lens,
            item_reqs=g.no_items,
            item_starts=g.no_items,
            block_m=1,
            full=_KeyLayout(indptr, kv_loc, page, None, g.full_splits),
            sliding=_KeyLayout(indptr, sliding_loc, page, window, g.sliding_splits),
            out_slots=out_slots,
            sliding_out_slots=sliding_out_slots,
        )

    def forward(
        self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, is_sliding: bool
    ) -> Tensor:
        plan = self.planned(self._plan)
        meta = plan.meta
        shape = meta.shape
        out_slots = plan.out_slots
        if layer_id in kv_cache.sliding:  # exactly where KVCache.write puts them
            out_slots = plan.sliding_out_slots
            if out_slots is None:
                out_slots = kv_cache.sliding_slots(plan.out_slots)
        k_all, v_all = kv_cache.layer_kv(layer_id)
        store_kv(k_all, v_all, out_slots, k, v)

        keys = plan.sliding if is_sliding else plan.full
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = dict(
            scale=shape.scale,
            page_size=keys.page_size,
            softcap=shape.logit_softcap,
            window=keys.window,
            block_n=self.block_n,
        )
        if plan.decode_reqs.numel():
            decode_attention(
                q,
                k_all,
                v_all,
                out,
                plan.decode_reqs,
                plan.decode_rows,
                plan.seq_lens,
                keys.loc_indptr,
                keys.kv_loc,
                num_kv_splits=keys.num_kv_splits,
                **common,
            )
        if plan.item_reqs.numel():
            extend_attention(
                q,
                k_all,
                v_all,
                out,
                plan.item_reqs,
                plan.item_starts,
                meta.qo_indptr,
                meta.prefix_lens,
                meta.extend_lens,
                keys.loc_indptr,
                keys.kv_loc,
                block_m=plan.block_m,
                **common,
            )
        return out
