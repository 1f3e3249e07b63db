"""Extend attention: ragged chunks of new tokens over their cached prefix plus themselves,
causal, cut into work items of `block_m` new tokens (`extend_work_items`). Key locations,
GQA, soft-capping and windows: the package docstring.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from torch import Tensor

from kernels.triton_ops.common import (
    NEG_BIG,
    LazyJit,
    dot_precision,
    last_dim_contiguous,
    pow2_block,
)


@LazyJit
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
    return max(1, max(16, block_rows) // pow2_block(group_size))


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
    block_g = pow2_block(group)
    if block_m * block_g < 16:
        raise ValueError("block_m x the padded group size must be at least 16 rows")
    q = last_dim_contiguous(q)
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
        BLOCK_D=pow2_block(dim, 16),
        BLOCK_N=max(16, block_n),
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        DOT_PRECISION=dot_precision(k_cache.dtype),
    )
    return out
