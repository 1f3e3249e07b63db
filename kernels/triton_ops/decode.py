"""Split-KV decode attention: one query token per request over all its keys, cut into
`num_kv_splits` key ranges attended by separate programs whose partial softmaxes a second
kernel merges. Key locations, GQA, soft-capping and windows: the package docstring.
"""

from __future__ import annotations

import torch
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


@LazyJit
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
    q = last_dim_contiguous(q)
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
    block_d = pow2_block(dim, 16)
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
        BLOCK_H=pow2_block(group, 16),
        BLOCK_D=block_d,
        BLOCK_N=max(16, block_n),
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        SPLIT=split,
        DOT_PRECISION=dot_precision(k_cache.dtype),
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
            BLOCK_S=pow2_block(num_kv_splits),
            BLOCK_D=block_d,
        )
    return out
