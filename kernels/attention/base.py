"""The attention backend interface and the per-forward metadata every backend plans from.

A backend is driven in two phases, the FlashInfer way:
  * `plan(meta)` once per forward, with everything about the batch's shape and KV layout;
  * `forward(layer_id, q, k, v, kv_cache, is_sliding)` once per layer: store the new K/V
    at `meta.out_slots`, then attend each query over its request's keys (causal, and
    limited to the last `sliding_window` positions on sliding layers).

`AttentionMetadata` keeps the ragged-batch description in FlashInfer's terms: `qo_indptr`
over the flattened new tokens; `kv_indptr`/`kv_indices` over each request's slots for
positions [0, seq_len); `paged_kv()` regroups those slots into page ids plus
`kv_last_page_len` for BatchPrefill/DecodeWithPagedKVCacheWrapper.plan; `window_left`
is FlashInfer's spelling of the sliding window (keys in [q - window_left, q]).

Host to device: `build` computes every index array on the host (`paged_kv`'s too) and
stages them in one `HostStaging` transfer, then gathers the slots from the req-to-token
table on the device; nothing in it waits for the device (the slot check that would is made
only when the table is on the CPU).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from kernels.forward_batch import ForwardBatch
from kernels.host_staging import HostStaging
from kernels.kv_cache import KVCache, ReqToTokenTable


@dataclass(frozen=True)
class AttentionShape:
    """Per-model attention constants a backend needs at plan time."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    logit_softcap: float | None
    sliding_window: int | None

    @classmethod
    def of(cls, config) -> AttentionShape:
        """The shape of a model's attention (`config`: its `kernels.config.ModelConfig`)."""
        return cls(
            num_q_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.attn_scale,
            logit_softcap=config.attn_logit_softcap,
            sliding_window=config.sliding_window,
        )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class PagedKvLayout:
    """Page-granular KV description (FlashInfer's paged_kv_* plan arguments)."""

    kv_page_indptr: Tensor  # int32 [B + 1]
    kv_page_indices: Tensor  # int32 [num_pages_used]
    kv_last_page_len: Tensor  # int32 [B], in [1, page_size]
    kv_page_indptr_host: np.ndarray  # int32, the same on the host (planners want it there)
    kv_last_page_len_host: np.ndarray


def paged_host_arrays(
    seq_lens: np.ndarray, kv_indptr: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For `AttentionMetadata.paged_kv`: the kv_indices position of each used page's first
    key (int64), the page indptr and the last pages' lengths (int32). Valid because the
    allocator places position p of a row at offset p % page_size of its page (pages are
    filled in order)."""
    pages_per_req = (seq_lens + page_size - 1) // page_size
    page_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(pages_per_req, out=page_indptr[1:])
    firsts = np.repeat(kv_indptr[:-1] - page_indptr[:-1] * page_size, pages_per_req)
    first_pos = firsts + np.arange(int(page_indptr[-1]), dtype=np.int64) * page_size
    last_len = (seq_lens - (pages_per_req - 1) * page_size).astype(np.int32)
    return first_pos, page_indptr.astype(np.int32), last_len


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything about one forward's batch that attention needs, built once per forward.

    Invariants: request i's new tokens are q rows [qo_indptr[i], qo_indptr[i+1]) at positions
    prefix_lens[i] + arange(extend_lens[i]); its keys are kv_indices[kv_indptr[i] :
    kv_indptr[i+1]] for positions 0 .. seq_lens[i] - 1, in order; the last extend_lens[i]
    of them are out_slots[qo_indptr[i] : qo_indptr[i+1]].
    """

    shape: AttentionShape
    page_size: int
    qo_indptr: Tensor  # int32 [B + 1]
    kv_indptr: Tensor  # int32 [B + 1]
    kv_indices: Tensor  # int64 [sum(seq_lens)], slot ids
    seq_lens: Tensor  # int32 [B]
    prefix_lens: Tensor  # int32 [B]
    extend_lens: Tensor  # int32 [B]
    positions: Tensor  # int64 [T]
    out_slots: Tensor  # int64 [T]
    # Host copies for backends that loop or size buffers on the CPU side.
    qo_indptr_host: np.ndarray
    kv_indptr_host: np.ndarray
    seq_lens_host: np.ndarray
    prefix_lens_host: np.ndarray
    extend_lens_host: np.ndarray
    # Sliding layers' slot of a full slot (identity when the KV pools are one): their keys
    # are read at these, their new K/V written there by `KVCache.write`.
    sliding_slots: Callable[[Tensor], Tensor] | None = None
    # The caller's `extra` host arrays of `build`, on the device, in order (same transfer).
    extra: tuple[Tensor, ...] = field(default=(), compare=False, repr=False)
    # `paged_kv`'s host arrays (`paged_host_arrays`) and their device copies, staged by
    # `build` with the rest; None: `paged_kv` stages them itself, through `staging`.
    paged_staged: tuple | None = field(default=None, compare=False, repr=False)
    staging: HostStaging | None = field(default=None, compare=False, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr_host[-1])

    @property
    def is_decode_only(self) -> bool:
        return bool((self.extend_lens_host == 1).all())

    @property
    def window_left(self) -> int:
        """FlashInfer's window_left: -1 for full attention, else sliding_window - 1."""
        window = self.shape.sliding_window
        return -1 if window is None else window - 1

    @cached_property
    def paged_kv(self) -> PagedKvLayout:
        """Page ids per request (see `paged_host_arrays`)."""
        staged = self.paged_staged
        if staged is None:
            host = paged_host_arrays(self.seq_lens_host, self.kv_indptr_host, self.page_size)
            staging = self.staging or HostStaging(self.kv_indices.device)
            staged = (*host, *staging.to_device(host))
        first_pos, indptr32, last_len, first_pos_t, indptr_t, last_len_t = staged
        return PagedKvLayout(
            kv_page_indptr=indptr_t,
            kv_page_indices=(self.kv_indices[first_pos_t] // self.page_size).to(torch.int32),
            kv_last_page_len=last_len_t,
            kv_page_indptr_host=indptr32,
            kv_last_page_len_host=last_len,
        )

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        req_to_token: ReqToTokenTable,
        kv_cache: KVCache,
        shape: AttentionShape,
        validate: bool = True,
        staging: HostStaging | None = None,
        extra: Sequence[np.ndarray] = (),
    ) -> AttentionMetadata:
        """Gather slots from the req-to-token table (whose deltas are already applied).

        All host arrays, the caller's `extra` ones included (they come back as `meta.extra`),
        go to the table's device in one `staging.to_device` call (default: a fresh
        `HostStaging`). `validate` checks the rows' capacity on the host, and that every new
        token has a slot outside the padding page only when the table is on the CPU: on a
        GPU that check would wait for the device, so it is skipped there.
        """
        device = req_to_token.device
        rows = np.asarray(batch.rows, dtype=np.int64)
        prefix = np.asarray(batch.prefix_lens, dtype=np.int64)
        extend = batch.extend_lens
        seq = batch.seq_lens
        if validate and (seq > req_to_token.row_capacity).any():
            raise ValueError("a request runs past its req-to-token row capacity")

        qo_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(extend, out=qo_indptr[1:])
        kv_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(seq, out=kv_indptr[1:])
        num_tokens = int(qo_indptr[-1])
        num_kv = int(kv_indptr[-1])

        # Position of each new token, and of each key, within its own request.
        starts = np.repeat(prefix - qo_indptr[:-1], extend)
        positions = np.arange(num_tokens, dtype=np.int64) + starts
        token_rows = np.repeat(rows, extend)
        kv_rows = np.repeat(rows, seq)
        kv_cols = np.arange(num_kv, dtype=np.int64) - np.repeat(kv_indptr[:-1], seq)

        i32 = np.int32
        host = [qo_indptr.astype(i32), kv_indptr.astype(i32), seq.astype(i32)]
        host += [prefix.astype(i32), extend.astype(i32), positions, token_rows, kv_rows, kv_cols]
        paged = paged_host_arrays(seq, kv_indptr, kv_cache.page_size)
        if staging is None:
            staging = HostStaging(device)
        staged = staging.to_device([*host, *paged, *extra])
        qo_t, kv_t, seq_t, prefix_t, extend_t, positions_t = staged[:6]
        token_rows_t, kv_rows_t, kv_cols_t = staged[6:9]

        table = req_to_token.table
        out_slots = table[token_rows_t, positions_t].long()
        kv_indices = table[kv_rows_t, kv_cols_t].long()
        if validate and device.type == "cpu":
            if int(out_slots.min()) < kv_cache.first_valid_slot:
                raise ValueError("a new token has no slot (req-to-token entry in the padding page)")

        return cls(
            shape=shape,
            page_size=kv_cache.page_size,
            qo_indptr=qo_t,
            kv_indptr=kv_t,
            kv_indices=kv_indices,
            seq_lens=seq_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            positions=positions_t,
            out_slots=out_slots,
            qo_indptr_host=qo_indptr,
            kv_indptr_host=kv_indptr,
            seq_lens_host=seq,
            prefix_lens_host=prefix,
            extend_lens_host=extend,
            sliding_slots=kv_cache.sliding_slots if kv_cache.split else None,
            extra=tuple(staged[12:]),
            paged_staged=(*paged, *staged[9:12]),
            staging=staging,
        )


class AttentionBackend(ABC):
    """Plan once per forward, run once per layer. Implementations register by name."""

    name: ClassVar[str] = "abstract"

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare index tensors / kernel plans for the batch described by `meta`."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, is_sliding: bool
    ) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the batch's new tokens -> output [T, Hq, D].

        Writes k/v into `kv_cache` at the planned slots before attending.
        """

    @staticmethod
    def planned(plan):
        """`plan` (what `plan()` stored), or the error of a forward before any plan."""
        if plan is None:
            raise RuntimeError("plan() must run before forward()")
        return plan


_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}


BackendClass = type[AttentionBackend]


def register_attention_backend(name: str) -> Callable[[BackendClass], BackendClass]:
    def decorator(cls: BackendClass) -> BackendClass:
        _REGISTRY[name] = cls
        return cls

    return decorator


# Each backend's module, imported only when that backend is asked for: a CPU engine never
# imports the GPU ones (nor their packages).
BACKEND_MODULES = {
    "torch": "kernels.attention.torch_ref",
    "flashinfer": "kernels.attention.flashinfer_backend",
    "triton": "kernels.attention.triton_backend",
}


def make_attention_backend(name: str, **options) -> AttentionBackend:
    """Instantiate a backend by name ("torch" is the CPU reference; "flashinfer" and
    "triton" run on CUDA and take `device` and `dtype` options)."""
    if name not in _REGISTRY and name in BACKEND_MODULES:
        importlib.import_module(BACKEND_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKEND_MODULES)}")
    return _REGISTRY[name](**options)


def available_attention_backends() -> list[str]:
    return sorted(BACKEND_MODULES)
