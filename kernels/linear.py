"""The decoder's linear layers: fused projections, and oneDNN-packed weights on the CPU.

Fused projections (as vLLM's and SGLang's stacked parameters): each attention block holds
one `qkv_proj` (q, k and v weights stacked along the output dimension, in that order) and
each MLP one `gate_up_proj` (gate, then up). Checkpoints name the parts separately;
`stack_projections` maps their tensors to the model's names when a model is built. One
product instead of three (or two) reads the same bytes with fewer, larger kernel calls.

oneDNN packing: on the CPU, `F.linear` hands each product to MKL or oneDNN on the weight's
plain layout, which suits skinny decode shapes (a few rows against a wide weight) poorly.
`pack_linears` reorders every decoder linear's weight once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the same path as `LmHead`'s oneDNN backend)
and multiplies with `torch.ops.mkldnn._linear_pointwise`; the plain weight is dropped, so
memory stays one copy. fp32 results differ from `F.linear` by rounding only (a different
summation order).

Packing is opt-in (`model.linear = "onednn"`; the default is "aten"), because the two
kinds of CPU measured disagree. On an AVX-512 CPU with native bf16 (bf16 weights), a bare
executor loop ran decode steps faster with packed weights, yet the whole engine served
slower with them (`bin/engine bench offline --set model.linear=...`), for a reason not found
yet. On an AVX2-only CPU (fp32 weights) packing made a bare batch-32 decode step ~20%
faster and `bin/engine bench serve` at 32 concurrent ~9% faster. The stacked projections
help either way.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor, nn

# fused module name -> its parts, in the order their outputs are stacked
STACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
LINEAR_BACKENDS = ("aten", "onednn")


def stack_projections(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoint-named tensors -> the model's: `*.q_proj.weight`, `*.k_proj.weight` and
    `*.v_proj.weight` become one `*.qkv_proj.weight` (biases likewise), gate and up become
    `*.gate_up_proj.*`. Every other tensor passes through unchanged."""
    out = dict(weights)
    for name in weights:
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        for fused, parts in STACKED_PROJECTIONS.items():
            if part != parts[0]:
                continue
            names = [f"{parent}.{p}.{leaf}" for p in parts]
            missing = [n for n in names if n not in out]
            if missing:
                raise ValueError(f"{name} has no matching {', '.join(missing)}")
            out[f"{parent}.{fused}.{leaf}"] = torch.cat([out.pop(n) for n in names])
    return out


class OneDnnLinear(nn.Module):
    """`nn.Linear` on a oneDNN-packed copy of its weight (CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        # An opaque oneDNN tensor: kept as a plain attribute (not a buffer), since module
        # state_dict / .to() cannot handle its layout.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.weight_bytes = weight.numel() * weight.element_size()

    @property
    def weight(self) -> Tensor:
        """A plain [out, in] copy of the weight (for tools such as quantization)."""
        return self.packed.to_dense()

    def __deepcopy__(self, memo: dict) -> OneDnnLinear:
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        plain.weight = nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return OneDnnLinear(plain)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


@cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        linear = nn.Linear(16, 8, bias=True).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        got = OneDnnLinear(linear)(x)
        want = nn.functional.linear(x, linear.weight, linear.bias)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


def choose_linear_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The decoder linears' backend: "onednn" where asked for and oneDNN runs `dtype` on this
    CPU (else an error naming why), "aten" otherwise."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {requested!r}")
    if requested == "aten":
        return "aten"
    if device.type != "cpu":
        raise ValueError(f"the onednn linear backend is a CPU path, not {device}")
    if not onednn_linear_works(dtype):
        raise ValueError(f"oneDNN cannot run {dtype} linears on this CPU; use aten")
    return "onednn"


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` inside `module` by a `OneDnnLinear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            module.add_module(name, OneDnnLinear(child))  # replaces the submodule of that name
            count += 1
        else:
            count += pack_linears(child)
    return count
