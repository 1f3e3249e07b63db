"""The CPU reference attention backend: gathers paged K/V and calls torch SDPA.

Decode requests (one new token) are attended in groups of similar context length: each
group's keys are gathered into a padded [B, L] slot matrix once per forward (padding lanes
point at the reserved slot 0 and are masked out), and each layer runs one batched SDPA per
group. Grouping (`decode_groups`) bounds the padding: gathering and attending a padded lane
costs as much as a real one, and one batch of contexts from 50 to 600 tokens padded to the
longest wastes about half the step's attention work. Prefill chunks are attended one
request at a time with an explicit causal (and sliding-window) mask over the request's
cached prefix plus the chunk. Sliding layers gather only the keys their window can reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    register_attention_backend,
)
from kernels.kv_cache import KVCache


@dataclass(frozen=True)
class _KeySet:
    """Keys for a group of queries: slot ids and a boolean mask (True = attend), or no mask."""

    slots: Tensor  # int64, [B, L] for decode, [L] for one prefill request
    mask: Tensor | None  # bool, [B, 1, 1, L] for decode, [E, L] for prefill


@dataclass(frozen=True)
class _DecodePlan:
    """One group of decode requests attended together."""

    token_index: Tensor | None  # q rows of the group's requests; None when they are all rows
    full: _KeySet
    sliding: _KeySet


# A group's fixed cost (its own gathers, SDPA call and row scatter in every layer), in padded
# key lanes: splitting a group pays when it removes more padding than this.
DECODE_GROUP_COST_LANES = 256


def decode_groups(
    lengths: np.ndarray, group_cost: int = DECODE_GROUP_COST_LANES
) -> list[np.ndarray]:
    """Partition decode requests (their key counts `lengths`) into groups minimizing
    sum(group size x longest in group) + group_cost x groups, i.e. padded lanes plus a fixed
    cost per group. Groups are runs of the requests sorted by length (an optimal partition
    has that form); exact by dynamic programming, O(n^2) numpy steps for n requests.
    Returns index arrays into `lengths`, each in ascending request order."""
    n = lengths.size
    # One group is optimal when its padding is at most one group's cost: any split costs at
    # least sum(lengths) + 2 x group_cost. This covers batch 1 and equal lengths at no cost.
    if n <= 1 or n * int(lengths.max()) - int(lengths.sum()) <= group_cost:
        return [np.arange(n)]
    order = np.argsort(-lengths, kind="stable")  # longest first
    widths = lengths[order].astype(np.int64)
    # best[j]: cost of grouping the j longest requests; a group of sorted i..j-1 is as
    # wide as its first (longest) member.
    best = np.zeros(n + 1, dtype=np.int64)
    cut = np.zeros(n + 1, dtype=np.int64)
    starts = np.arange(n, dtype=np.int64)
    for j in range(1, n + 1):
        costs = best[:j] + (j - starts[:j]) * widths[:j] + group_cost
        i = int(np.argmin(costs))
        best[j], cut[j] = costs[i], i
    groups = []
    j = n
    while j > 0:
        i = int(cut[j])
        groups.append(np.sort(order[i:j]))
        j = i
    return groups[::-1]


@dataclass(frozen=True)
class _PrefillPlan:
    begin: int  # q rows [begin, end)
    end: int
    full: _KeySet
    sliding: _KeySet


def _padded_keys(kv_indices: Tensor, starts: np.ndarray, lengths: np.ndarray) -> _KeySet:
    """Slots kv_indices[starts[b] + j] for j < lengths[b], padded with slot 0 to max length."""
    width = int(lengths.max())
    device = kv_indices.device
    lanes = np.arange(width, dtype=np.int64)
    valid = lanes[None, :] < lengths[:, None]
    flat = np.where(valid, starts[:, None] + lanes[None, :], 0)
    slots = kv_indices[torch.from_numpy(flat).to(device)]
    valid_t = torch.from_numpy(valid).to(device)
    slots = torch.where(valid_t, slots, torch.zeros_like(slots))
    mask = None if valid.all() else valid_t[:, None, None, :]
    return _KeySet(slots=slots, mask=mask)


def _prefill_keys(
    kv_indices: Tensor, kv_start: int, prefix: int, extend: int, window: int | None
) -> _KeySet:
    """Keys for query positions prefix .. prefix+extend-1 attending causally (and windowed)."""
    seq = prefix + extend
    first = 0 if window is None else max(0, prefix - window + 1)
    slots = kv_indices[kv_start + first : kv_start + seq]
    device = kv_indices.device
    q_pos = torch.arange(prefix, seq, device=device)[:, None]
    k_pos = torch.arange(first, seq, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return _KeySet(slots=slots, mask=mask)


@register_attention_backend("torch")
class TorchRefBackend(AttentionBackend):
    """Reference attention on any torch device (used on CPU)."""

    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._decode: list[_DecodePlan] = []
        self._prefills: list[_PrefillPlan] = []
        # Reused gather buffers for K and V: fresh multi-MB allocations per layer cost more
        # (page faults) than the gather itself on CPU.
        self._workspace: list[Tensor | None] = [None, None]

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        to_sliding = meta.sliding_slots or (lambda slots: slots)
        window = meta.shape.sliding_window
        extend = meta.extend_lens_host
        seq = meta.seq_lens_host
        kv_start = meta.kv_indptr_host[:-1]
        decode_reqs = np.flatnonzero(extend == 1)
        self._decode = []
        groups = decode_groups(seq[decode_reqs]) if decode_reqs.size else []
        for members in groups:
            reqs = decode_reqs[members]
            dec_seq = seq[reqs]
            dec_start = kv_start[reqs]
            full = _padded_keys(meta.kv_indices, dec_start, dec_seq)
            sliding = full
            if window is not None and int(dec_seq.max()) > window:
                skip = np.maximum(dec_seq - window, 0)
                sliding = _padded_keys(meta.kv_indices, dec_start + skip, dec_seq - skip)
            sliding = _KeySet(slots=to_sliding(sliding.slots), mask=sliding.mask)
            all_rows = reqs.size == meta.batch_size
            token_index = (
                None
                if all_rows
                else torch.from_numpy(meta.qo_indptr_host[reqs]).to(meta.kv_indices.device)
            )
            self._decode.append(_DecodePlan(token_index=token_index, full=full, sliding=sliding))
        self._prefills = []
        for r in np.flatnonzero(extend > 1):
            prefix = int(meta.prefix_lens_host[r])
            ext = int(extend[r])
            full = _prefill_keys(meta.kv_indices, int(kv_start[r]), prefix, ext, None)
            sliding = full
            if window is not None and prefix + ext > window:
                sliding = _prefill_keys(meta.kv_indices, int(kv_start[r]), prefix, ext, window)
            sliding = _KeySet(slots=to_sliding(sliding.slots), mask=sliding.mask)
            begin = int(meta.qo_indptr_host[r])
            self._prefills.append(_PrefillPlan(begin, begin + ext, full, sliding))

    def forward(
        self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, is_sliding: bool
    ) -> Tensor:
        meta = self.planned(self._meta)
        kv_cache.write(layer_id, meta.out_slots, k, v)
        k_all, v_all = kv_cache.layer_kv(layer_id)
        shape = meta.shape
        if len(self._decode) == 1 and self._decode[0].token_index is None:
            group = self._decode[0]
            return self._attend_decode(q, k_all, v_all, group.sliding if is_sliding else group.full)
        out = torch.empty_like(q)
        for group in self._decode:
            keys = group.sliding if is_sliding else group.full
            out.index_copy_(
                0,
                group.token_index,
                self._attend_decode(q.index_select(0, group.token_index), k_all, v_all, keys),
            )
        for plan in self._prefills:
            keys = plan.sliding if is_sliding else plan.full
            out[plan.begin : plan.end] = _attend(
                q[plan.begin : plan.end].transpose(0, 1).unsqueeze(0),  # [1, Hq, E, D]
                self._gather(0, k_all, keys.slots).transpose(0, 1).unsqueeze(0),  # [1,Hkv,L,D]
                self._gather(1, v_all, keys.slots).transpose(0, 1).unsqueeze(0),
                keys.mask,
                shape.scale,
                shape.logit_softcap,
                shape.group_size,
            )[0].transpose(0, 1)
        return out

    def _attend_decode(self, q: Tensor, k_all: Tensor, v_all: Tensor, keys: _KeySet) -> Tensor:
        """One query per request; query heads sharing a KV head become rows of one group."""
        shape = self._meta.shape
        batch = q.shape[0]
        # HF's repeat_kv order: query head h reads KV head h // group_size.
        q_grouped = q.view(batch, shape.num_kv_heads, shape.group_size, shape.head_dim)
        k = self._gather(0, k_all, keys.slots).transpose(1, 2)  # [B, Hkv, L, D]
        v = self._gather(1, v_all, keys.slots).transpose(1, 2)
        out = _attend(q_grouped, k, v, keys.mask, shape.scale, shape.logit_softcap, 1)
        return out.reshape(batch, shape.num_q_heads, shape.head_dim)

    def _gather(self, which: int, source: Tensor, slots: Tensor) -> Tensor:
        """source[slots] written into reusable workspace `which` (valid until the next call)."""
        count = slots.numel()
        row_shape = source.shape[1:]
        buf = self._workspace[which]
        if (
            buf is None
            or buf.shape[0] < count
            or buf.dtype != source.dtype
            or buf.device != source.device
            or buf.shape[1:] != row_shape
        ):
            # Grow geometrically: decode contexts grow by one token per step.
            old = 0 if buf is None else buf.shape[0]
            buf = torch.empty(
                (max(count, 2 * old, 1024), *row_shape), dtype=source.dtype, device=source.device
            )
            self._workspace[which] = buf
        out = buf[:count]
        torch.index_select(source, 0, slots.reshape(-1), out=out)
        return out.view(*slots.shape, *row_shape)


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    softcap: float | None,
    group_size: int,
) -> Tensor:
    """Masked attention; q [..., Hq, E, D], k/v [..., Hkv, L, D] with Hq = Hkv * group_size."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=group_size > 1
        )
    if group_size > 1:
        k = k.repeat_interleave(group_size, dim=-3)
        v = v.repeat_interleave(group_size, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
