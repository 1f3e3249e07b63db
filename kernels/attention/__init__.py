"""Attention backends behind one plan/forward interface (see base.py); "torch" on CPU."""

from __future__ import annotations

from kernels.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    PagedKvLayout,
    available_attention_backends,
    make_attention_backend,
    register_attention_backend,
)
from kernels.attention.torch_ref import TorchRefBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "PagedKvLayout",
    "TorchRefBackend",
    "available_attention_backends",
    "make_attention_backend",
    "register_attention_backend",
]
