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
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from kernels.forward_batch import ForwardBatch
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
        """Page ids per request; valid because the allocator places position p of a row at
        offset p % page_size of its page (pages are filled in order)."""
        page = self.page_size
        pages_per_req = (self.seq_lens_host + page - 1) // page
        page_indptr = np.zeros(self.batch_size + 1, dtype=np.int64)
        np.cumsum(pages_per_req, out=page_indptr[1:])
        firsts = np.repeat(self.kv_indptr_host[:-1] - page_indptr[:-1] * page, pages_per_req)
        first_pos = firsts + np.arange(int(page_indptr[-1]), dtype=np.int64) * page
        device = self.kv_indices.device
        page_ids = self.kv_indices[torch.from_numpy(first_pos).to(device)] // page
        last_len = (self.seq_lens_host - (pages_per_req - 1) * page).astype(np.int32)
        indptr32 = page_indptr.astype(np.int32)
        return PagedKvLayout(
            kv_page_indptr=torch.from_numpy(indptr32).to(device),
            kv_page_indices=page_ids.to(torch.int32),
            kv_last_page_len=torch.from_numpy(last_len).to(device),
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
    ) -> AttentionMetadata:
        """Gather slots from the req-to-token table (whose deltas are already applied)."""
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

        table = req_to_token.table
        positions_t = torch.from_numpy(positions).to(device)
        out_slots = table[torch.from_numpy(token_rows).to(device), positions_t].long()
        kv_rows_t = torch.from_numpy(kv_rows).to(device)
        kv_indices = table[kv_rows_t, torch.from_numpy(kv_cols).to(device)].long()
        if validate and int(out_slots.min()) < kv_cache.first_valid_slot:
            raise ValueError("a new token has no slot (req-to-token entry in the padding page)")

        def dev32(a: np.ndarray) -> Tensor:
            return torch.from_numpy(a.astype(np.int32)).to(device)

        return cls(
            shape=shape,
            page_size=kv_cache.page_size,
            qo_indptr=dev32(qo_indptr),
            kv_indptr=dev32(kv_indptr),
            kv_indices=kv_indices,
            seq_lens=dev32(seq),
            prefix_lens=dev32(prefix),
            extend_lens=dev32(extend),
            positions=positions_t,
            out_slots=out_slots,
            qo_indptr_host=qo_indptr,
            kv_indptr_host=kv_indptr,
            seq_lens_host=seq,
            prefix_lens_host=prefix,
            extend_lens_host=extend,
            sliding_slots=kv_cache.sliding_slots if kv_cache.split else None,
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
