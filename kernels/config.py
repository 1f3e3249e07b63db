"""The model description every loader produces and every kernel reads.

`ModelConfig` is the one architecture-neutral record of a decoder-only model: shapes,
rotary settings per layer type, sliding-window pattern, norm flavour, soft-caps and
special token ids. Loaders (GGUF, Hugging Face folders) fill it; models, the KV cache
and the executor only read it. It is frozen: a loaded model never changes shape.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal


class UnsupportedModelError(ValueError):
    """The model asks for a feature kvactor does not implement (a clear error at load)."""


ArchName = Literal["gemma3", "llama", "qwen2", "qwen3"]
LayerType = Literal["full_attention", "sliding_attention"]
SUPPORTED_ARCHS: tuple[str, ...] = ("gemma3", "llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters for one layer type (HF `rope_parameters` semantics).

    `kind` is "default", "linear" (inv_freq / factor) or "llama3" (frequency-banded
    scaling); `factor` and the llama3 fields are unused for "default".
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, default_theta: float) -> RopeSpec:
        """Build from one HF `rope_parameters` dict (or legacy `rope_scaling`)."""
        params = dict(params or {})
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope type {kind!r} is not supported")
        return cls(
            theta=float(params.get("rope_theta", default_theta)),
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only LM; enough to build it and run it."""

    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # Rotary settings: `rope` for full-attention layers, `rope_local` for sliding ones.
    rope: RopeSpec
    rope_local: RopeSpec
    # One entry per layer; "sliding_attention" layers see only the last `sliding_window` keys.
    layer_types: tuple[str, ...]
    sliding_window: int | None
    norm_eps: float
    hidden_act: str
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (head_dim when None).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    tie_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    max_position: int = 8192
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; known: {SUPPORTED_ARCHS}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must have one entry per layer")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if any(t == "sliding_attention" for t in self.layer_types) and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")

    # Derived properties (never stored, so they cannot disagree with the fields).
    @property
    def is_gemma(self) -> bool:
        return self.arch == "gemma3"

    @property
    def attn_scale(self) -> float:
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(scalar) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def rope_for(self, layer: int) -> RopeSpec:
        return self.rope_local if self.is_sliding(layer) else self.rope

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sliding(i))

    # JSON round trip, used by the weight cache to store the config next to the weights.
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw = json.loads(text)
        raw["rope"] = RopeSpec(**raw["rope"])
        raw["rope_local"] = RopeSpec(**raw["rope_local"])
        raw["layer_types"] = tuple(raw["layer_types"])
        raw["eos_ids"] = tuple(raw["eos_ids"])
        return cls(**raw)


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's pattern: layer i is global when (i + 1) % pattern == 0, else sliding."""
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    )
