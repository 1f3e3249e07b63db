"""Triton kernels over the KV cache and the req-to-token table, on the device: `store_kv`
(`KVCache.write`'s copy), `apply_slot_deltas` (`ReqToTokenTable.apply_slot_deltas`) and
`paged_kv_indices` (`AttentionMetadata.paged_kv`). See the package docstring for the modes.
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from kernels.triton_ops.common import LazyJit, last_dim_contiguous, pow2_block


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------
@LazyJit
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
    k = last_dim_contiguous(k)
    v = last_dim_contiguous(v)
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
        BLOCK_H=pow2_block(heads),
        BLOCK_D=pow2_block(dim),
    )


# ---------------------------------------------------------------------------------------------
# apply_slot_deltas
# ---------------------------------------------------------------------------------------------
@LazyJit
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
@LazyJit
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
