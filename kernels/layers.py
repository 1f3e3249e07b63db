"""Building blocks shared by the model definitions: norms, rotary embedding, gated MLP.

Each block reproduces the arithmetic of its HF transformers counterpart operation for
operation (same dtype casts, same order), so fp32 outputs match HF to rounding noise.
Tensors are token-major and ragged-batch flat: [num_tokens, ...]; no batch dimension.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.config import RopeSpec, UnsupportedModelError


class RMSNorm(nn.Module):
    """Llama/Qwen RMSNorm: normalize in fp32, cast back, then multiply by `weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # F.rms_norm == x * rsqrt(mean(x^2) + eps), bit for bit, in one fused kernel.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: the scale is (1 + weight), applied in fp32 before casting back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self._scale: Tensor | None = None  # fp32 (1 + weight), rebuilt if weight is replaced
        self._scale_of: Tensor | None = None

    def scale(self) -> Tensor:
        if torch.compiler.is_compiling():  # a graph folds it in; no cached state to guard
            return 1.0 + self.weight.float()
        if self._scale_of is not self.weight:
            self._scale = 1.0 + self.weight.float()
            self._scale_of = self.weight
        return self._scale

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).type_as(x)


def activation(name: str):
    """The MLP activation by its HF name."""
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    raise UnsupportedModelError(f"activation {name!r}")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), the MLP of Llama, Qwen and Gemma; gate and up are one
    stacked product (`gate_up_proj`)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, as HF's rope init functions compute them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.kind == "linear":
        inv_freq = inv_freq / spec.factor
    elif spec.kind == "llama3":
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif spec.kind != "default":
        raise UnsupportedModelError(f"rope kind {spec.kind!r}")
    return inv_freq


class RotaryCache:
    """cos/sin tables for one RopeSpec, evaluated for a batch's positions once per forward.

    Returns tensors [num_tokens, 1, head_dim] in `dtype`, broadcasting over heads.
    """

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.inv_freq = rope_inv_freq(spec, head_dim).to(device)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, 1, head_dim] (HF's rotate_half layout)."""
    return (x * cos) + (rotate_half(x) * sin)
