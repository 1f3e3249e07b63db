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
    meta: AttentionMetadata
    decode_reqs: Tensor  # int32 [Bd]: requests with one new token
    decode_rows: Tensor  # int64 [Bd]: their q row
    item_reqs: Tensor  # int32 [W]: extend work items (request, first new token)
    item_starts: Tensor  # int32 [W]
    block_m: int
    full: _KeyLayout
    sliding: _KeyLayout
    sliding_out_slots: Tensor | None  # out_slots in the sliding pool (split caches)


@register_attention_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton, planned once per forward.

    Options: `block_n` keys per inner iteration; `block_rows` query rows (new tokens x the
    query heads of one KV head) per extend program; decode requests are split over up to
    `max_kv_splits` programs per (request, KV head), one per `kv_split_tokens` keys, and
    only while the batch has fewer than `min_programs` (request, KV head) pairs;
    `use_pages` reads keys through page ids (FlashInfer's layout) instead of slot lists.
    `device`, `dtype` and `graph_max_pages` are the options the runner gives every GPU
    backend: the first two are recorded only (the kernels follow the tensors they are given),
    the last ignored (this backend has no `plan_graph`, so decode CUDA graphs refuse it).
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
        self._plan: _Plan | None = None

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
            if page == 1:
                sliding_loc = meta.sliding_slots(loc)
            else:
                first_slots = loc.long() * page
                sliding_loc = (meta.sliding_slots(first_slots) // page).to(loc.dtype)

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

        def dev(a: np.ndarray, dtype: torch.dtype) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        self._plan = _Plan(
            meta=meta,
            decode_reqs=dev(decode, torch.int32),
            decode_rows=dev(meta.qo_indptr_host[decode], torch.int64),
            item_reqs=dev(item_reqs, torch.int32),
            item_starts=dev(item_starts, torch.int32),
            block_m=block_m,
            full=full,
            sliding=sliding,
            sliding_out_slots=(
                None if meta.sliding_slots is None else meta.sliding_slots(meta.out_slots)
            ),
        )

    def forward(
        self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, is_sliding: bool
    ) -> Tensor:
        plan = self.planned(self._plan)
        meta = plan.meta
        shape = meta.shape
        out_slots = meta.out_slots
        if layer_id in kv_cache.sliding:  # exactly where KVCache.write puts them
            out_slots = plan.sliding_out_slots
            if out_slots is None:
                out_slots = kv_cache.sliding_slots(meta.out_slots)
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
                meta.seq_lens,
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
