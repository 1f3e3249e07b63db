"""What a model's layers see during one forward, besides the hidden states.

The executor builds one `ForwardContext` per forward (and the CUDA-graph capture one per
bucket) from its attention backend, its KV cache and the batch's rotary tables; the model
definitions (`kernels.models`) read only this, never the executor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from kernels.attention.base import AttentionBackend
from kernels.kv_cache import KVCache


@dataclass
class ForwardContext:
    """What a model's layers need during one forward besides the hidden states.

    `rope` maps a layer type ("full_attention" / "sliding_attention") to the (cos, sin)
    tables [T, 1, head_dim] for this batch's positions, computed once per forward.
    `reduce` sums a row-parallel product (o_proj, down_proj) over the tensor-parallel ranks
    (kernels/tensor_parallel.py); None when one rank holds the whole model.
    """

    attention: AttentionBackend
    kv_cache: KVCache
    rope: dict[str, tuple[Tensor, Tensor]]
    reduce: Callable[[Tensor], Tensor] | None = None

    def summed(self, partial: Tensor) -> Tensor:
        """A row-parallel product summed over the ranks (itself on one rank)."""
        return partial if self.reduce is None else self.reduce(partial)
