"""Triton kernels of the GPU model runner, each behind a thin launcher (torch in, torch out).

  * `store_kv`          new K/V rows into the cache at their slots (the `KVCache.write` copy);
  * `apply_slot_deltas` runs of slots into the req-to-token table, on the device
                        (`ReqToTokenTable.apply_slot_deltas`);
  * `paged_kv_indices`  a batch's page lists from the req-to-token table, on the device
                        (`AttentionMetadata.paged_kv`, optionally mapped to the sliding pool);
  * `decode_attention`  one query token per request over all its keys (split-KV, then a
                        merge of the splits' partial softmaxes);
  * `extend_attention`  ragged query chunks over their cached prefix plus themselves, causal.

Both attention kernels read a request's keys through a location list: with `page_size == 1`
the list holds the slot of each key (`AttentionMetadata.kv_indices`), otherwise page ids
(`PagedKvLayout.kv_page_indices`), key j of a request then living at slot
`pages[j // page_size] * page_size + j % page_size`. Query head h reads KV head
h // group_size (HF's repeat_kv order); one program handles all the query heads of a KV head,
so each K/V block is loaded once per group. Scores are `scale * q.k` in float32, soft-capped
(`softcap * tanh(s / softcap)`) when asked, limited to keys at positions
`> q_pos - window` on windowed layers, and normalised with an online softmax in float32.

Modes: the kernels are handed to `triton.jit` when first launched, not when this module is
imported, and again if `TRITON_INTERPRET` (`triton.knobs.runtime.interpret`) has changed
since: `triton.jit` reads that setting when it decorates, so decorating at import would tie
the kernels to whatever the environment said when something first imported this module.
Under the interpreter they run on CPU tensors (that is how they are tested); compiled, on
CUDA tensors. For the same reason no kernel calls a `@triton.jit` helper of its own. Those
of triton.language itself (tl.zeros, tl.max, tl.sum) are decorated when triton.language is
first imported, so interpreting also needs TRITON_INTERPRET set before that import (or
those helpers swapped for interpreted copies, as tests/model/test_triton_kernels.py does).

Shapes assumed: K/V caches are [num_slots, num_kv_heads, head_dim] with a unit stride on
the last dimension (`KVCache.layer_kv`), q/k/v/out [tokens, heads, head_dim] (made
contiguous on the last dimension when they are not); head_dim is any size (padded to a power
of two of at least 16 inside the kernels, masked); num_q_heads a multiple of num_kv_heads.
The dot products take the cache's dtype (q is cast to it); with float32 caches they run in
IEEE float32 (no TF32), so fp32 results match a float32 reference to ~1e-6.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

# Finite "minus infinity" for running maxima (no inf - inf anywhere); a constexpr, the only
# kind of global a compiled kernel may read.
NEG_BIG = tl.constexpr(-1.0e30)


class _LazyJit:
    """`triton.jit(fn)`, made on first launch (and per interpreter setting)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jitted: dict[bool, Any] = {}

    def jitted(self) -> Any:
        interpret = bool(triton.knobs.runtime.interpret)
        kernel = self._jitted.get(interpret)
        if kernel is None:
            kernel = self._jitted[interpret] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def _block(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(max(int(n), 1)))


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for float32 operands (TF32 would cost ~1e-3); the default (which
    only concerns fp32) otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------
@_LazyJit
def _store_kv_kernel(
    k_cache,
    v_cache,
    slots,
    k,
    v,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    kv = tl.load(k + t * stride_k_t + h * stride_k_h + d, mask=mask)
    tl.store(
        k_cache + slot * stride_kc_s + h * stride_kc_h + d,
        kv.to(k_cache.dtype.element_ty),
        mask=mask,
    )
    vv = tl.load(v + t * stride_v_t + h * stride_v_h + d, mask=mask)
    tl.store(
        v_cache + slot * stride_vc_s + h * stride_vc_h + d,
        vv.to(v_cache.dtype.element_ty),
        mask=mask,
    )


def store_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t], cast to the caches' dtype.

    k_cache/v_cache [S, H, D] (unit stride on D), slots int64 [T] (distinct, in [0, S)),
    k/v [T, H, D] (any strides). One program per token; nothing is returned.
    """
    num_tokens = slots.numel()
    if num_tokens == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache needs a unit stride on head_dim")
    _, heads, dim = k_cache.shape
    if k.shape != (num_tokens, heads, dim) or v.shape != (num_tokens, heads, dim):
        raise ValueError(f"k/v {tuple(k.shape)} do not match {num_tokens} x cache rows")
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k_cache,
        v_cache,
        slots,
        k,
        v,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_HEADS=heads,
        HEAD_DIM=dim,
        BLOCK_H=_block(heads),
        BLOCK_D=_block(dim),
    )


# ---------------------------------------------------------------------------------------------
# apply_slot_deltas
# ---------------------------------------------------------------------------------------------
@_LazyJit
def _slot_deltas_kernel(
    table,
    stride_row,
    rows,
    starts,
    lengths,
    run_offsets,
    flat_slots,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows + i).to(tl.int64)
    start = tl.load(starts + i).to(tl.int64)
    length = tl.load(lengths + i).to(tl.int32)
    src = tl.load(run_offsets + i).to(tl.int64)
    for j in range(0, length, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < length
        vals = tl.load(flat_slots + src + idx, mask=mask)
        tl.store(table + row * stride_row + start + idx, vals.to(tl.int32), mask=mask)


def apply_slot_deltas(
    table: Tensor,
    rows: Tensor,
    starts: Tensor,
    lengths: Tensor,
    flat_slots: Tensor,
    validate: bool = False,
) -> None:
    """table[rows[i], starts[i] : starts[i] + lengths[i]] = the i-th run of flat_slots.

    Same semantics as `ReqToTokenTable.apply_slot_deltas`, on device tensors: table int32
    [R, C] (unit column stride), rows/starts/lengths integer [N], flat_slots integer
    [sum(lengths)] (the runs concatenated in the order of rows). Runs must not overlap.
    One program per run. Checking the runs against the table (what the host version always
    does) synchronises with the device, so it only happens with `validate`.
    """
    num_runs = rows.numel()
    if num_runs == 0:
        return
    if table.stride(1) != 1:
        raise ValueError("the req-to-token table needs a unit column stride")
    flat_slots = flat_slots.reshape(-1)
    lengths = lengths.reshape(-1)
    ends = torch.cumsum(lengths.to(torch.int64), 0)
    if validate:
        total = int(ends[-1])
        if flat_slots.numel() != total:
            raise ValueError(f"{flat_slots.numel()} slots for runs of total length {total}")
        if bool((starts < 0).any()) or bool((starts + lengths > table.shape[1]).any()):
            raise ValueError("slot delta runs past the row capacity")
        if bool((rows < 0).any()) or bool((rows >= table.shape[0]).any()):
            raise ValueError("slot delta names a row outside the table")
    run_offsets = ends - lengths
    _slot_deltas_kernel[(num_runs,)](
        table,
        table.stride(0),
        rows.reshape(-1),
        starts.reshape(-1),
        lengths,
        run_offsets,
        flat_slots,
        BLOCK=128,
    )


# ---------------------------------------------------------------------------------------------
# paged_kv_indices
# ---------------------------------------------------------------------------------------------
@_LazyJit
def _paged_kv_indices_kernel(
    table,
    stride_row,
    rows,
    seq_lens,
    page_indptr,
    page_map,
    out,
    PAGE_SIZE: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    seq = tl.load(seq_lens + b).to(tl.int32)
    num_pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
    dst = tl.load(page_indptr + b).to(tl.int64)
    for j in range(0, num_pages, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < num_pages
        # The first position of each page carries the page id.
        slot = tl.load(table + row * stride_row + idx.to(tl.int64) * PAGE_SIZE, mask=mask, other=0)
        page = slot.to(tl.int64) // PAGE_SIZE
        if HAS_MAP:
            page = tl.load(page_map + page, mask=mask, other=0)
        tl.store(out + dst + idx, page.to(tl.int32), mask=mask)


def paged_kv_indices(
    table: Tensor,
    rows: Tensor,
    seq_lens: Tensor,
    page_size: int,
    page_map: Tensor | None = None,
    num_pages: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(kv_page_indptr int32 [B+1], kv_page_indices int32 [N], kv_last_page_len int32 [B]).

    Request b (req-to-token row rows[b], keys at positions [0, seq_lens[b])) uses pages
    table[rows[b], p] // page_size for p = 0, page_size, 2 * page_size, ... < seq_lens[b]
    (the allocator fills pages in order, so a page's first position names it): the same
    layout as `AttentionMetadata.paged_kv`. With `page_map` (int64, full page -> sliding
    page: `KVCache.swa_map`) the ids are mapped through it: the sliding layers' page list.
    N, the total page count, is read back from the device unless `num_pages` gives it.
    One program per request.
    """
    if table.stride(1) != 1:
        raise ValueError("the req-to-token table needs a unit column stride")
    device = table.device
    seq = seq_lens.to(device=device, dtype=torch.int64).reshape(-1)
    pages_per_req = (seq + page_size - 1) // page_size
    indptr = torch.zeros(seq.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(pages_per_req, 0, out=indptr[1:])
    last_len = (seq - (pages_per_req - 1) * page_size).to(torch.int32)
    if num_pages is None:
        num_pages = int(indptr[-1])
    indptr = indptr.to(torch.int32)
    out = torch.empty(num_pages, dtype=torch.int32, device=device)
    if seq.numel() and num_pages:
        _paged_kv_indices_kernel[(seq.numel(),)](
            table,
            table.stride(0),
            rows.reshape(-1),
            seq,
            indptr,
            table if page_map is None else page_map,
            out,
            PAGE_SIZE=page_size,
            HAS_MAP=page_map is not None,
            BLOCK=128,
        )
    return indptr, out, last_len


# ---------------------------------------------------------------------------------------------
# decode attention (split-KV)
# ---------------------------------------------------------------------------------------------
@_LazyJit
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    out,
    mid_out,
    mid_lse,
    req_ids,
    q_rows,
    seq_lens,
    loc_indptr,
    kv_loc,
    stride_q_t,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    scale,
    softcap,
    window,
    num_splits,
    GROUP: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(req_ids + i)
    row = tl.load(q_rows + i).to(tl.int64)
    seq = tl.load(seq_lens + req).to(tl.int32)
    loc_base = tl.load(loc_indptr + req).to(tl.int64)
    # The query sits at position seq - 1; a window keeps keys at positions >= seq - window.
    lo = seq * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq - window, 0)
    chunk = (seq - lo + num_splits - 1) // num_splits
    split_lo = lo + split * chunk
    split_hi = tl.minimum(split_lo + chunk, seq)

    g = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    qv = tl.load(
        q + row * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(k_cache.dtype.element_ty)

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(split_lo, split_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < split_hi
        if PAGE_SIZE == 1:
            slot = tl.load(kv_loc + loc_base + pos, mask=n_mask, other=0).to(tl.int64)
        else:
            page = tl.load(kv_loc + loc_base + pos // PAGE_SIZE, mask=n_mask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kb = tl.load(
            k_cache + slot[:, None] * stride_k_s + kv_head * stride_k_h + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(qv, tl.trans(kb), input_precision=DOT_PRECISION) * scale
        if HAS_SOFTCAP:
            # softcap * tanh(s / softcap), tanh from exp(-2|x|) (no overflow, no libdevice)
            x = s / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            s = softcap * tl.where(x < 0, -th, th)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(
            v_cache + slot[:, None] * stride_v_s + kv_head * stride_v_h + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    if SPLIT:
        # Partials per (request, query head, split): normalised output and log-sum-exp; an
        # empty split leaves lse ~ -1e30 and weighs nothing in the merge.
        part = (i * NUM_Q_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(
            mid_out + part[:, None] * HEAD_DIM + d[None, :],
            result,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(mid_lse + part, m_i + tl.log(tl.maximum(l_i, 1.0e-30)), mask=g_mask)
    else:
        tl.store(
            out + row * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
            result.to(out.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@_LazyJit
def _decode_merge_kernel(
    mid_out,
    mid_lse,
    out,
    q_rows,
    stride_o_t,
    stride_o_h,
    num_splits,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(q_rows + i).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    d_mask = d < HEAD_DIM
    base = (i * NUM_Q_HEADS + head).to(tl.int64) * num_splits
    lse = tl.load(mid_lse + base + sp, mask=s_mask, other=NEG_BIG)
    parts = tl.load(
        mid_out + (base + sp)[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    weight = tl.exp(lse - tl.max(lse, 0))
    merged = tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0)
    tl.store(
        out + row * stride_o_t + head * stride_o_h + d,
        merged.to(out.dtype.element_ty),
        mask=d_mask,
    )


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    req_ids: Tensor,
    q_rows: Tensor,
    seq_lens: Tensor,
    loc_indptr: Tensor,
    kv_loc: Tensor,
    *,
    scale: float,
    page_size: int = 1,
    softcap: float | None = None,
    window: int | None = None,
    num_kv_splits: int = 1,
    block_n: int = 64,
) -> Tensor:
    """Attention of one query token per request over all its keys; writes and returns `out`.

    For each i, request req_ids[i] has its query at q[q_rows[i]] (position seq - 1, with
    seq = seq_lens[req]) and keys at positions 0 .. seq - 1, located through
    kv_loc[loc_indptr[req] : ...] (slots when page_size == 1, else page ids); the result goes
    to out[q_rows[i]]. With `window`, only keys at positions >= seq - window count. q/out
    [T, Hq, D], k_cache/v_cache [S, Hkv, D]. The keys are cut into `num_kv_splits` equal
    ranges attended by separate programs, whose partial softmaxes a second kernel merges
    (grid: requests x KV heads x splits, then requests x query heads).
    """
    num_reqs = req_ids.numel()
    if num_reqs == 0:
        return out
    num_q_heads, dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    q = _last_dim_contiguous(q)
    split = num_kv_splits > 1
    if split:
        mid_out = torch.empty(
            (num_reqs, num_q_heads, num_kv_splits, dim), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty(
            (num_reqs, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device
        )
    else:
        mid_out = mid_lse = out
    block_d = _block(dim, 16)
    _decode_kernel[(num_reqs, num_kv_heads, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        out,
        mid_out,
        mid_lse,
        req_ids,
        q_rows,
        seq_lens,
        loc_indptr,
        kv_loc,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        num_kv_splits,
        GROUP=group,
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=dim,
        PAGE_SIZE=page_size,
        BLOCK_H=_block(group, 16),
        BLOCK_D=block_d,
        BLOCK_N=max(16, block_n),
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        SPLIT=split,
        DOT_PRECISION=_dot_precision(k_cache.dtype),
    )
    if split:
        _decode_merge_kernel[(num_reqs, num_q_heads)](
            mid_out,
            mid_lse,
            out,
            q_rows,
            out.stride(0),
            out.stride(1),
            num_kv_splits,
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=dim,
            BLOCK_S=_block(num_kv_splits),
            BLOCK_D=block_d,
        )
    return out


# ---------------------------------------------------------------------------------------------
# extend attention (ragged prefill chunks over a cached prefix)
# ---------------------------------------------------------------------------------------------
@_LazyJit
def _extend_kernel(
    q,
    k_cache,
    v_cache,
    out,
    item_reqs,
    item_starts,
    qo_indptr,
    prefix_lens,
    extend_lens,
    loc_indptr,
    kv_loc,
    stride_q_t,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    w = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(item_reqs + w)
    m0 = tl.load(item_starts + w).to(tl.int32)
    q_start = tl.load(qo_indptr + req).to(tl.int64)
    prefix = tl.load(prefix_lens + req).to(tl.int32)
    extend = tl.load(extend_lens + req).to(tl.int32)
    loc_base = tl.load(loc_indptr + req).to(tl.int64)

    # Row r of the block: new token m0 + r // BLOCK_G, query head kv_head * GROUP + r % BLOCK_G.
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    m = m0 + r // BLOCK_G
    g = r % BLOCK_G
    row_mask = (m < extend) & (g < GROUP)
    q_pos = prefix + m
    tokens = q_start + m.to(tl.int64)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    qv = tl.load(
        q + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=io_mask,
        other=0.0,
    ).to(k_cache.dtype.element_ty)

    # Keys this block can see: up to its last query, from its first query's window on.
    hi = prefix + tl.minimum(m0 + BLOCK_M, extend)
    lo = prefix * 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0)

    m_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        if PAGE_SIZE == 1:
            slot = tl.load(kv_loc + loc_base + pos, mask=n_mask, other=0).to(tl.int64)
        else:
            page = tl.load(kv_loc + loc_base + pos // PAGE_SIZE, mask=n_mask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kb = tl.load(
            k_cache + slot[:, None] * stride_k_s + kv_head * stride_k_h + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(qv, tl.trans(kb), input_precision=DOT_PRECISION) * scale
        if HAS_SOFTCAP:
            # softcap * tanh(s / softcap), tanh from exp(-2|x|) (no overflow, no libdevice)
            x = s / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            s = softcap * tl.where(x < 0, -th, th)
        allowed = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(
            v_cache + slot[:, None] * stride_v_s + kv_head * stride_v_h + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    tl.store(
        out + tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
        (acc / safe_l[:, None]).to(out.dtype.element_ty),
        mask=io_mask,
    )


def extend_block_m(group_size: int, block_rows: int = 64) -> int:
    """New tokens per extend program: block_rows query rows (tokens x the group's heads)."""
    return max(1, max(16, block_rows) // _block(group_size))


def extend_work_items(
    reqs: np.ndarray, extend_lens: np.ndarray, block_m: int
) -> tuple[np.ndarray, np.ndarray]:
    """(request, first new token) of each extend program: requests `reqs` cut into blocks of
    block_m new tokens (host arrays, int32)."""
    reqs = np.asarray(reqs, dtype=np.int64)
    blocks = (np.asarray(extend_lens, dtype=np.int64)[reqs] + block_m - 1) // block_m
    item_reqs = np.repeat(reqs, blocks)
    firsts = np.repeat(np.cumsum(blocks) - blocks, blocks)
    item_starts = (np.arange(int(blocks.sum()), dtype=np.int64) - firsts) * block_m
    return item_reqs.astype(np.int32), item_starts.astype(np.int32)


def extend_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    item_reqs: Tensor,
    item_starts: Tensor,
    qo_indptr: Tensor,
    prefix_lens: Tensor,
    extend_lens: Tensor,
    loc_indptr: Tensor,
    kv_loc: Tensor,
    *,
    scale: float,
    block_m: int,
    page_size: int = 1,
    softcap: float | None = None,
    window: int | None = None,
    block_n: int = 64,
) -> Tensor:
    """Causal attention of ragged new-token chunks over their prefix plus themselves.

    Request b's new tokens are q rows [qo_indptr[b], qo_indptr[b] + extend_lens[b]) at
    positions prefix_lens[b] + arange(extend_lens[b]); its keys (positions 0 ..
    prefix + extend - 1, the new ones already stored) are located through
    kv_loc[loc_indptr[b] : ...] (slots when page_size == 1, else page ids). Token at q_pos
    attends to keys at positions <= q_pos (and > q_pos - window with `window`). One program
    per work item (item_reqs[w], new tokens item_starts[w] .. + block_m; see
    `extend_work_items`, with block_m from `extend_block_m`) and KV head. Writes and
    returns `out` [T, Hq, D] at the items' rows only.
    """
    num_items = item_reqs.numel()
    if num_items == 0:
        return out
    num_q_heads, dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    block_g = _block(group)
    if block_m * block_g < 16:
        raise ValueError("block_m x the padded group size must be at least 16 rows")
    q = _last_dim_contiguous(q)
    _extend_kernel[(num_items, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        item_reqs,
        item_starts,
        qo_indptr,
        prefix_lens,
        extend_lens,
        loc_indptr,
        kv_loc,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        GROUP=group,
        HEAD_DIM=dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_D=_block(dim, 16),
        BLOCK_N=max(16, block_n),
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        DOT_PRECISION=_dot_precision(k_cache.dtype),
    )
    return out
