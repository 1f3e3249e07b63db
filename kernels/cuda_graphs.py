"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed when a step fits.

A pure decode step of n requests (one new token each, logits for all) runs as the graph of
the smallest bucket >= n (`DECODE_BUCKETS`); larger steps, prefills and mixed steps run
eagerly. The graph reads only static buffers: before each replay the step's token ids and
positions, padded on the host, go into them in one staged non-blocking copy
(`kernels.host_staging`), and the attention backend plans its fixed-size buffers for the
bucket (page lists, lengths, output slots) outside the graph (`plan_graph`). The bucket's
padding rows point at the reserved page 0 (slot 0, position 0, token 0) and their logits
are dropped, so they write nothing a request reads.

Capture happens the first time a bucket is needed, during that real step: two eager
warm-up runs on a side stream (they write the step's K/V, which the replay writes again,
identically), then the capture; all buckets share one memory pool. Sampling stays one
device-to-host copy of the step's logits (one sync per step, not per request).

`bucket_for` and `pad_layout` are plain torch (unit-tested on the CPU); `DecodeGraphs`
needs CUDA and a backend with `plan_graph` (`GRAPH_BACKENDS`: FlashInfer, Triton).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from kernels.forward_context import ForwardContext
from kernels.host_staging import HostStaging

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_BACKENDS = ("flashinfer", "triton")  # backends that plan into fixed buffers (`plan_graph`)


def graph_max_pages(row_capacity: int, page_size: int) -> int:
    """Pages the largest bucket's batch may reference (its requests' pages, plus padding)."""
    return max(DECODE_BUCKETS) * (-(-row_capacity // page_size) + 1)


def graph_request_pages(max_pages: int) -> int:
    """Pages per request of a `graph_max_pages` budget (a row's pages plus one): a bucket of
    b requests references at most b times this many."""
    return max_pages // max(DECODE_BUCKETS)


def bucket_for(n: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> int | None:
    """The smallest bucket that holds n requests (None: run eagerly)."""
    return next((b for b in buckets if b >= n), None)


def pad_layout(layout, bucket: int):
    """A `FlashInferLayout` of n requests padded to `bucket`: each padding request has one
    key, in page 0 (the reserved padding page), and one query."""
    n = len(layout.kv_last_page_len_host)
    extra = bucket - n
    if extra < 0:
        raise ValueError(f"{n} requests do not fit a bucket of {bucket}")
    if extra == 0:
        return layout
    indptr = layout.kv_page_indptr_host
    pad_indptr = indptr[-1] + torch.arange(1, extra + 1, dtype=indptr.dtype)
    qo = layout.qo_indptr_host
    pad_qo = qo[-1] + torch.arange(1, extra + 1, dtype=qo.dtype)
    zeros = torch.zeros(
        extra, dtype=layout.kv_page_indices.dtype, device=layout.kv_page_indices.device
    )
    return replace(
        layout,
        qo_indptr_host=torch.cat([qo, pad_qo]),
        kv_page_indptr_host=torch.cat([indptr, pad_indptr]),
        kv_page_indices=torch.cat([layout.kv_page_indices, zeros]),
        kv_last_page_len_host=torch.cat(
            [layout.kv_last_page_len_host, torch.ones(extra, dtype=torch.int32)]
        ),
    )


def padded(values: Tensor, bucket: int) -> Tensor:
    """`values` [n] followed by zeros up to `bucket` entries."""
    out = torch.zeros(bucket, dtype=values.dtype, device=values.device)
    out[: values.shape[0]] = values
    return out


@dataclass
class _Graph:
    inputs: Tensor  # int64 [2, bucket]: token ids, then positions (one staged copy)
    logits: Tensor | None = None  # float32 [bucket, vocab], written by each replay
    graph: object | None = None  # torch.cuda.CUDAGraph

    @property
    def input_ids(self) -> Tensor:
        return self.inputs[0]

    @property
    def positions(self) -> Tensor:
        return self.inputs[1]


class DecodeGraphs:
    """Captures and replays the decode graphs of one executor (CUDA only)."""

    def __init__(self, executor, buckets: tuple[int, ...] = DECODE_BUCKETS) -> None:
        if executor.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        if not hasattr(executor.attention, "plan_graph"):
            raise RuntimeError(f"the {executor.attention.name} backend cannot run in a graph")
        self.executor = executor
        self.buckets = buckets
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._staging = HostStaging(executor.device)
        self.replays = 0

    @property
    def captured_buckets(self) -> list[int]:
        """The buckets whose graph has been captured, smallest first."""
        return sorted(self._graphs)

    def fits(self, batch) -> bool:
        return (
            batch.is_decode_only
            and all(batch.need_logits)
            and bucket_for(batch.batch_size, self.buckets) is not None
        )

    def run(self, batch, meta) -> Tensor:
        """float32 logits [n, vocab] of a decode batch that `fits`; `meta` is its planned
        metadata (slot deltas applied)."""
        n = batch.batch_size
        bucket = bucket_for(n, self.buckets)
        self.executor.attention.plan_graph(meta, bucket)
        g = self._graphs.get(bucket)
        if g is None:
            g = _Graph(
                inputs=torch.zeros(2, bucket, dtype=torch.int64, device=self.executor.device)
            )
        host = np.zeros((2, bucket), dtype=np.int64)  # padding: token 0 at position 0
        host[0, :n] = batch.flat_input_ids()
        host[1, :n] = meta.prefix_lens_host  # a decode token's position is its prefix length
        (staged,) = self._staging.to_device([host])
        g.inputs.copy_(staged, non_blocking=True)
        if g.graph is None:
            self._capture(g)
            self._graphs[bucket] = g
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]

    def _body(self, g: _Graph) -> Tensor:
        ex = self.executor
        rope = {t: cache.cos_sin(g.positions, ex.dtype) for t, cache in ex.rotary.items()}
        ctx = ForwardContext(attention=ex.attention, kv_cache=ex.kv_cache, rope=rope)
        return ex.lm_head(ex.model(g.input_ids, ctx, None))

    def _capture(self, g: _Graph) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(g)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            g.logits = self._body(g)
        g.graph = graph
