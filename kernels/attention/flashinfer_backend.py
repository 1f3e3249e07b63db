"""The FlashInfer attention backend (CUDA only; `pip install kvactor[gpu]`).

Per forward, `plan` turns the executor's `AttentionMetadata` into FlashInfer's paged-KV
layout (`flashinfer_layouts`, plain torch, unit-tested on CPU against the metadata's own
slots) and plans one wrapper per layer kind: `BatchDecodeWithPagedKVCacheWrapper` when every
request adds one token, `BatchPrefillWithPagedKVCacheWrapper` (causal, ragged queries over
a paged prefix) otherwise. Full layers attend over every page (`window_left = -1`); sliding
layers (Gemma 3's local ones) use `window_left = sliding_window - 1` and, when the sliding
layers have their own KV pool, the page ids mapped through `KVCache.swa_map` (pages whose
sliding KV was freed map to page 0, which the window never reaches). Every layer of the
step reuses its kind's plan: `forward` stores the step's K/V and calls `run`.

Logit soft-capping is passed through where a model has it (`logits_soft_cap`); the KV
layout is NHD: [pages, page_size, kv_heads, head_dim], `KVCache.paged(layer)`.

Every wrapper is pinned to FlashInfer's `fa2` backend (the tensor-core decode wrapper runs
the same prefill module), so a machine JIT-compiles only fa2 modules; `warm` compiles them
up front, for one model's shape, on a scratch KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    register_attention_backend,
)
from kernels.kv_cache import KVCache

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's float workspace (split-KV partials)
FI_BACKEND = "fa2"  # every wrapper's; "auto" would pick fa3 for prefill on SM90


@dataclass(frozen=True)
class FlashInferLayout:
    """One layer kind's plan arguments: CSR page lists (indptr on the host, as FlashInfer's
    planner wants them; indices on the device) and the window."""

    qo_indptr_host: Tensor  # int32 [B + 1]
    kv_page_indptr_host: Tensor  # int32 [B + 1]
    kv_page_indices: Tensor  # int32 [pages used], on the KV's device
    kv_last_page_len_host: Tensor  # int32 [B], in [1, page_size]
    window_left: int  # -1: every key; w: keys at positions >= q - w

    def slots(self, page_size: int) -> list[Tensor]:
        """Per request, the slot of each of its keys in order (what the pages expand to)."""
        out = []
        indptr = self.kv_page_indptr_host.tolist()
        last = self.kv_last_page_len_host.tolist()
        for b in range(len(last)):
            pages = self.kv_page_indices[indptr[b] : indptr[b + 1]].long()
            offsets = torch.arange(page_size, device=pages.device)
            slots = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)
            out.append(slots[: (len(pages) - 1) * page_size + last[b]])
        return out


def flashinfer_layouts(meta: AttentionMetadata) -> dict[str, FlashInferLayout]:
    """{"full": ..., "sliding": ...} (sliding only for a model with a sliding window)."""
    paged = meta.paged_kv
    qo = torch.from_numpy(meta.qo_indptr_host.astype(np.int32))
    indptr = torch.from_numpy(paged.kv_page_indptr_host)  # host copies: no device sync
    last = torch.from_numpy(paged.kv_last_page_len_host)
    layouts = {"full": FlashInferLayout(qo, indptr, paged.kv_page_indices, last, window_left=-1)}
    if meta.shape.sliding_window is not None:
        pages = paged.kv_page_indices
        if meta.sliding_slots is not None:  # the sliding layers' own pool: map the pages
            first_slots = pages.long() * meta.page_size
            pages = (meta.sliding_slots(first_slots) // meta.page_size).to(torch.int32)
        layouts["sliding"] = FlashInferLayout(qo, indptr, pages, last, meta.window_left)
    return layouts


@register_attention_backend("flashinfer")
class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer's batch wrappers, planned once per forward."""

    name = "flashinfer"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        graph_max_pages: int = 0,
    ) -> None:
        """`graph_max_pages`: the most pages one decode graph's batch may reference (its
        fixed index buffer's size; the KV pool's pages plus the largest bucket's padding);
        0 = no CUDA graphs."""
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(
                "the flashinfer attention backend needs the gpu extra: "
                "pip install 'kvactor[gpu]' (flashinfer-python)"
            ) from exc
        self.device = torch.device(device)
        self.dtype = dtype  # of q and of the KV cache
        if self.device.type != "cuda":
            raise RuntimeError(f"the flashinfer attention backend runs on CUDA, not {device}")
        self._flashinfer = flashinfer
        # zeroed: FlashInfer's decode wrapper wants its workspace zero at first use
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._workspace = workspace
        self.graph_max_pages = graph_max_pages
        self._graph_wrappers: dict[int, dict[str, object]] = {}  # bucket -> kind -> wrapper
        self._graph_slots: dict[int, Tensor] = {}  # bucket -> its static output slots
        kinds = ("full", "sliding")
        self._prefill = {k: self._prefill_wrapper() for k in kinds}
        self._decode = {k: self._decode_wrapper() for k in kinds}
        self._meta: AttentionMetadata | None = None
        self._wrappers: dict[str, object] = {}
        self._out_slots: Tensor | None = None

    def _prefill_wrapper(self):
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=FI_BACKEND
        )

    def _decode_wrapper(self, **graph_buffers):
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True, backend=FI_BACKEND, **graph_buffers
        )

    def _common(self, shape: AttentionShape, page_size: int, window_left: int) -> dict:
        return dict(
            num_qo_heads=shape.num_q_heads,
            num_kv_heads=shape.num_kv_heads,
            page_size=page_size,
            window_left=window_left,
            logits_soft_cap=shape.logit_softcap,
            sm_scale=shape.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._out_slots = meta.out_slots
        shape = meta.shape
        decode = meta.is_decode_only
        self._wrappers = {}
        for kind, layout in flashinfer_layouts(meta).items():
            common = self._common(shape, meta.page_size, layout.window_left)
            if decode:
                wrapper = self._decode[kind]
                wrapper.plan(
                    layout.kv_page_indptr_host,
                    layout.kv_page_indices,
                    layout.kv_last_page_len_host,
                    head_dim=shape.head_dim,
                    **common,
                )
            else:
                wrapper = self._prefill[kind]
                wrapper.plan(
                    layout.qo_indptr_host,
                    layout.kv_page_indptr_host,
                    layout.kv_page_indices,
                    layout.kv_last_page_len_host,
                    head_dim_qk=shape.head_dim,
                    causal=True,
                    **common,
                )
            self._wrappers[kind] = wrapper

    def plan_graph(self, meta: AttentionMetadata, bucket: int) -> None:
        """Plan a decode step padded to `bucket` into that bucket's fixed buffers (for
        `kernels.cuda_graphs`); padding requests read and write page 0 only."""
        from kernels.cuda_graphs import pad_layout, padded

        if not self.graph_max_pages:
            raise RuntimeError("this backend was built without CUDA-graph buffers")
        wrappers = self._graph_wrappers.get(bucket)
        if wrappers is None:
            wrappers = self._graph_wrappers[bucket] = {
                kind: self._decode_wrapper(
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.empty(
                        bucket + 1, dtype=torch.int32, device=self.device
                    ),
                    paged_kv_indices_buffer=torch.empty(
                        self.graph_max_pages, dtype=torch.int32, device=self.device
                    ),
                    paged_kv_last_page_len_buffer=torch.empty(
                        bucket, dtype=torch.int32, device=self.device
                    ),
                )
                for kind in ("full", "sliding")
            }
            self._graph_slots[bucket] = torch.zeros(bucket, dtype=torch.int64, device=self.device)
        self._meta = meta
        self._wrappers = {}
        for kind, layout in flashinfer_layouts(meta).items():
            p = pad_layout(layout, bucket)
            wrapper = wrappers[kind]
            wrapper.plan(
                p.kv_page_indptr_host,
                p.kv_page_indices,
                p.kv_last_page_len_host,
                head_dim=meta.shape.head_dim,
                **self._common(meta.shape, meta.page_size, p.window_left),
            )
            self._wrappers[kind] = wrapper
        slots = self._graph_slots[bucket]
        slots.copy_(padded(meta.out_slots, bucket))
        self._out_slots = slots

    def warm(self, shape: AttentionShape, page_size: int) -> float:
        """Plan and run one tiny prefill and one tiny decode per layer kind of `shape` on a
        scratch paged KV of 2 pages (JIT-compiling FlashInfer's modules on a fresh machine);
        the seconds it took, up to one synchronisation at the end. Uses wrappers of its own:
        the backend's plans are left as they were."""
        start = time.perf_counter()
        kv_shape = (2, page_size, shape.num_kv_heads, shape.head_dim)
        kv = tuple(torch.zeros(kv_shape, dtype=self.dtype, device=self.device) for _ in "kv")
        seq_len = page_size + 1  # one full page, one key on the second
        page_indptr = torch.tensor([0, 2], dtype=torch.int32)
        pages = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        last_len = torch.tensor([1], dtype=torch.int32)
        qo_indptr = torch.tensor([0, seq_len], dtype=torch.int32)
        q = torch.zeros(
            (seq_len, shape.num_q_heads, shape.head_dim), dtype=self.dtype, device=self.device
        )
        prefill, decode = self._prefill_wrapper(), self._decode_wrapper()
        windows = [-1]
        if shape.sliding_window is not None:
            windows.append(shape.sliding_window - 1)
        for window_left in windows:
            common = self._common(shape, page_size, window_left)
            prefill.plan(
                qo_indptr,
                page_indptr,
                pages,
                last_len,
                head_dim_qk=shape.head_dim,
                causal=True,
                **common,
            )
            prefill.run(q, kv)
            decode.plan(page_indptr, pages, last_len, head_dim=shape.head_dim, **common)
            decode.run(q[:1], kv)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def forward(
        self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, is_sliding: bool
    ) -> Tensor:
        self.planned(self._meta)
        kv_cache.write(layer_id, self._out_slots, k, v)
        wrapper = self._wrappers[
            "sliding" if is_sliding and "sliding" in self._wrappers else "full"
        ]
        return wrapper.run(q.contiguous(), kv_cache.paged(layer_id))
