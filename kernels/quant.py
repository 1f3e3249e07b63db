"""Weight-only quantization for CPU decode (opt-in: `model.quantization = "int8" | "int4"`).

A batch-1 decode step streams every weight once, so its speed is bytes per token: fp32
weights read 4 bytes a parameter, bf16 2, int8 1, int4 half a byte. Each linear layer's
weight (and the LM head's) is quantized and multiplied by one of torch's own CPU kernels,
accumulating in float:

* **int8**: per output channel, symmetric: w ~ q * scale, q in [-127, 127], scale =
  max |w_row| / 127 rounded to the dtype the kernel takes it in (so the rounding of the scale
  is folded into q, not left as a per-channel error); `torch._weight_int8pack_mm`.
* **int4**: per group of `INT4_GROUP` (32) input channels of each output channel,
  asymmetric, as llama.cpp's Q4_1 / Q4_K blocks: w ~ (q - 8) * scale + zero, q in [0, 15].
  Each group starts from its min/max range and refines (scale, min) by a few rounds of least
  squares against its own rounding (`INT4_REFINE_ROUNDS`; no round raises the
  group's squared error); `torch._weight_int4pack_mm_for_cpu`
  over `torch._convert_weight_to_int4pack_for_cpu`'s packing. The kernel needs the output
  channels in multiples of 16: others are padded with zero rows and cut from the result.

The input embedding keeps its full-precision table (a lookup reads one row).

A kernel's speed depends on the dtype of its activations, and not as the exact product's
does: with bf16 activations both beat the fp32 product even on an AVX2-only CPU, where bf16
matmuls are otherwise emulated; with fp32 activations they can be several times slower than
it. So the runner times the kernel with each candidate activation dtype (the model's, and
bf16) against the exact product on the model's own shape (`time_quantized_products`), runs
the products in the fastest one (`choose_activations`; activations are rounded to it for the
product only, the rest of the model keeps its dtype) and refuses the mode, with the timings,
where no quantized product beats the exact one.

Both are approximate; int4 is markedly so (its grid has 16 levels). The default stays the
exact path: `bin/engine bench quality` reports how far each mode's greedy outputs and
perplexity move from fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.quant_layout import INT4_GROUP, QUANTIZATIONS
from kernels.quant_layout import INT4_ROWS as _INT4_ROWS
from kernels.timing import timed_runs

INT4_REFINE_ROUNDS = 4
_FIT_ROWS = 16384  # output channels fitted at a time


def _check_kind(kind: str) -> None:
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {kind!r}")


# --- int8 ----------------------------------------------------------------------------------


def quantize_rows(
    weight: Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """(int8 [out, in], scales [out] in `scale_dtype`) with weight ~ q * scales[:, None].
    Rows are done `_FIT_ROWS` at a time: the float temporaries stay small for a
    vocabulary-sized head."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=scale_dtype)
    for start in range(0, weight.shape[0], _FIT_ROWS):
        w = weight[start : start + _FIT_ROWS].detach().float()
        chunk_scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(scale_dtype)
        scales[start : start + w.shape[0]] = chunk_scales
        q[start : start + w.shape[0]] = torch.round(w / chunk_scales.float()[:, None]).clamp(
            -127, 127
        )
    return q, scales


def int8_product(rows: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """rows [N, in] x int8 weight [out, in]: [N, out] in the input's dtype; the product runs
    with activations in the scales' dtype."""
    out = torch._weight_int8pack_mm(rows.to(scales.dtype), q, scales)
    return out.to(rows.dtype)


# --- int4 ----------------------------------------------------------------------------------


def quantize_groups(
    weight: Tensor,
    scale_dtype: torch.dtype = torch.float32,
    group: int = INT4_GROUP,
    rounds: int = INT4_REFINE_ROUNDS,
) -> tuple[Tensor, Tensor]:
    """(q int32 [out, in] in [0, 15], scales_zeros [in / group, out, 2] in `scale_dtype`)
    with weight[o, g * group + j] ~ (q - 8) * scale[g, o] + zero[g, o]."""
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(
            f"int4 quantizes groups of {group} input channels; {in_features} is not a multiple"
        )
    # In chunks of rows: the fit's float32 temporaries stay small for a vocabulary-sized head.
    parts = [
        _fit_groups(chunk, scale_dtype, group, rounds) for chunk in weight.detach().split(_FIT_ROWS)
    ]
    q = torch.cat([p[0] for p in parts])
    scales_zeros = torch.cat([p[1] for p in parts], dim=1)
    return q, scales_zeros


def _fit_groups(
    weight: Tensor, scale_dtype: torch.dtype, group: int, rounds: int
) -> tuple[Tensor, Tensor]:
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    low = w.amin(dim=-1)
    scale = (w.amax(dim=-1) - low).clamp(min=1e-12) / 15
    for _ in range(rounds):
        # Least squares for w ~ scale * q + low given this rounding of q.
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15)
        q_mean, w_mean = q.mean(dim=-1), w.mean(dim=-1)
        q_dev = q - q_mean[..., None]
        var = (q_dev * q_dev).sum(dim=-1)
        fitted = (q_dev * (w - w_mean[..., None])).sum(dim=-1) / var.clamp(min=1e-12)
        keep = (var == 0) | (fitted <= 0)  # a constant group, or a degenerate fit
        scale = torch.where(keep, scale, fitted)
        low = torch.where(keep, low, w_mean - scale * q_mean)
    # Round scale and zero as the kernel stores them, then fold that rounding into q.
    scale = scale.clamp(min=1e-12).to(scale_dtype)
    zero = (low + 8 * scale.float()).to(scale_dtype)
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.int32).reshape(out_features, in_features), scales_zeros


def dequantize_groups(q: Tensor, scales_zeros: Tensor) -> Tensor:
    """The float32 weight [out, in] that `quantize_groups`' output stands for."""
    group = q.shape[1] // scales_zeros.shape[0]
    scale = scales_zeros[..., 0].t().float().repeat_interleave(group, dim=1)
    zero = scales_zeros[..., 1].t().float().repeat_interleave(group, dim=1)
    return (q.float() - 8) * scale + zero


def pack_int4(q: Tensor, scales_zeros: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's packed weight and its scales/zeros, output channels padded with zero
    rows to a multiple of 16."""
    pad = -q.shape[0] % _INT4_ROWS
    if pad:
        q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)])
        scales_zeros = torch.cat(
            [scales_zeros, scales_zeros.new_zeros(scales_zeros.shape[0], pad, 2)], dim=1
        )
    return torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), scales_zeros.contiguous()


def int4_product(rows: Tensor, packed: Tensor, scales_zeros: Tensor, out_features: int) -> Tensor:
    """rows [N, in] x packed int4 weight: [N, out_features] in the input's dtype; the product
    runs with activations in the scales' dtype."""
    group = rows.shape[1] // scales_zeros.shape[0]
    out = torch._weight_int4pack_mm_for_cpu(
        rows.to(scales_zeros.dtype).contiguous(), packed, group, scales_zeros
    )
    if out.shape[1] != out_features:
        out = out[:, :out_features]
    return out.to(rows.dtype)


# --- either kind ---------------------------------------------------------------------------


class QuantizedPart(NamedTuple):
    """A weight a loader read already quantized (`kernels.gguf_int4`): `quantize_part`'s
    output for `kind`, ready for `QuantizedWeight.from_parts`."""

    kind: str
    q: Tensor
    scales: Tensor


def quantize_part(weight: Tensor, kind: str, activations: torch.dtype) -> tuple[Tensor, Tensor]:
    """One weight's unpacked quantization: int8 (q [out, in], scales [out]) or int4 (q uint8
    [out, in], scales_zeros [in / group, out, 2]). Every output row is quantized on its own,
    so the parts of stacked projections (q, k, v) concatenate along the output channels
    (`QuantizedWeight.from_parts`) into what quantizing the stacked weight gives."""
    _check_kind(kind)
    if kind == "int8":
        return quantize_rows(weight, activations)
    q, scales_zeros = quantize_groups(weight, activations)
    return q.to(torch.uint8), scales_zeros


class QuantizedWeight:
    """One [out, in] weight in `kind`, its products run with activations in `activations`
    (the dtype its scales are stored in)."""

    def __init__(self, weight: Tensor, kind: str, activations: torch.dtype) -> None:
        self._assemble(kind, [quantize_part(weight, kind, activations)])

    @classmethod
    def from_parts(cls, kind: str, parts: list[tuple[Tensor, Tensor]]) -> QuantizedWeight:
        """The weight whose output rows are `parts` (of `quantize_part`) stacked in order."""
        _check_kind(kind)
        self = cls.__new__(cls)
        self._assemble(kind, parts)
        return self

    def _assemble(self, kind: str, parts: list[tuple[Tensor, Tensor]]) -> None:
        self.kind = kind
        q = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        self.out_features, self.in_features = q.shape
        if kind == "int8":
            scales = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            self.tensors = (q.contiguous(), scales)
        else:
            scales_zeros = torch.cat([p[1] for p in parts], dim=1)
            self.tensors = pack_int4(q.to(torch.int32), scales_zeros)

    def product(self, rows: Tensor) -> Tensor:
        """rows [N, in] (contiguous) -> [N, out] in the rows' dtype."""
        if self.kind == "int8":
            return int8_product(rows, *self.tensors)
        return int4_product(rows, *self.tensors, self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class QuantizedLinear(nn.Module):
    """`nn.Linear` (no bias or with one) over a quantized weight, its product run with
    activations in `activations` (default: the weight's dtype)."""

    def __init__(
        self,
        linear: nn.Module | None = None,  # nn.Linear, or a packed one of kernels.linear
        kind: str = "int8",
        activations: torch.dtype | None = None,
        *,
        quantized: QuantizedWeight | None = None,  # instead of `linear`: a weight made
        bias: Tensor | None = None,  # already (loaders quantize tensor by tensor)
    ) -> None:
        super().__init__()
        if quantized is None:
            quantized = QuantizedWeight(linear.weight, kind, activations or linear.weight.dtype)
            bias = linear.bias
        self.quantized = quantized
        self.in_features = quantized.in_features
        self.out_features = quantized.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def kind(self) -> str:
        return self.quantized.kind

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        out = self.quantized.product(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class Int4Embedding(nn.Module):
    """An embedding table kept in int4 rows: codes two a byte and a (scale, zero) per
    `INT4_GROUP` columns, as a GGUF's 4-bit blocks give them (`kernels.gguf_int4`, lossless);
    a lookup widens only the rows asked for, to `dtype`. A Llama-8B-sized table is 0.33 GB
    instead of 1 GB in bf16. `weight` is a one-element stand-in with the table's shape, dtype
    and device, for code that reads those; it holds no values."""

    def __init__(self, codes: Tensor, scales_zeros: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        rows, cols = codes.shape
        codes = codes.to(torch.uint8)
        self.register_buffer("packed", codes[:, 0::2] | (codes[:, 1::2] << 4))
        # [rows, groups, 2]: a lookup gathers whole rows
        self.register_buffer("scales_zeros", scales_zeros.transpose(0, 1).contiguous())
        self.weight = torch.zeros((), dtype=dtype).expand(rows, cols)

    def forward(self, ids: Tensor) -> Tensor:
        packed = self.packed[ids]  # [..., cols / 2]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).float()
        scales_zeros = self.scales_zeros[ids].float()  # [..., groups, 2]
        grouped = codes.unflatten(-1, (scales_zeros.shape[-2], INT4_GROUP))
        rows = (grouped - 8) * scales_zeros[..., :1] + scales_zeros[..., 1:]
        return rows.flatten(-2).to(self.weight.dtype)


def quantize_linears(
    module: nn.Module, kind: str = "int8", activations: torch.dtype | None = None
) -> int:
    """Replace every `nn.Linear` (plain or packed) inside `module` by a `QuantizedLinear` of
    `kind` computing with `activations`; returns how many."""
    from kernels.linear import PACKED_FORMS

    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, *PACKED_FORMS)):
            # replaces the submodule of that name
            module.add_module(name, QuantizedLinear(child, kind, activations))
            count += 1
        else:
            count += quantize_linears(child, kind, activations)
    return count


def quantized_supported(kind: str, activations: torch.dtype = torch.float32) -> bool:
    """Whether torch's `kind` weight-only matmul runs here with `activations`."""
    _check_kind(kind)
    try:
        weight = torch.zeros(_INT4_ROWS, INT4_GROUP)
        QuantizedWeight(weight, kind, activations).product(
            torch.zeros(1, INT4_GROUP, dtype=activations)
        )
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def time_quantized_products(
    kind: str,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    rows: int = 1,
    repeats: int = 7,
) -> tuple[dict[torch.dtype, float], float]:
    """Best-of-`repeats` seconds of one [rows, in] x [out, in] product: `kind` with each
    activation dtype that runs here (`dtype`, bf16), and the exact `dtype` product."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    quantized_s = {}
    for activations in dict.fromkeys((dtype, torch.bfloat16)):
        if quantized_supported(kind, activations):
            product = QuantizedWeight(weight, kind, activations).product
            # One warm-up call each: kernel selection, first touch of the output.
            quantized_s[activations] = min(timed_runs(lambda p=product: p(x), repeats))
    return quantized_s, min(timed_runs(lambda: F.linear(x, weight), repeats))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def choose_activations(
    kind: str,
    quantized_s: dict[torch.dtype, float],
    exact_s: float,
    dtype: torch.dtype,
    require_faster: bool = True,
) -> tuple[torch.dtype | None, str]:
    """The activation dtype whose `kind` product is fastest, if it beats the exact `dtype`
    product or `require_faster` is off (else None), with the figures as the reason."""
    figures = ", ".join(
        [f"{kind} with {_name(a)} activations {s * 1e6:.0f} us" for a, s in quantized_s.items()]
        + [f"exact {_name(dtype)} {exact_s * 1e6:.0f} us per batch-1 product"]
    )
    fastest = min(quantized_s, key=quantized_s.__getitem__, default=None)
    if fastest is not None and quantized_s[fastest] < exact_s:
        return (
            fastest,
            f"{kind} weights are faster here with {_name(fastest)} activations ({figures})",
        )
    if fastest is not None and not require_faster:
        return (
            fastest,
            f"{kind} weights are slower than the exact {_name(dtype)} path on this CPU but "
            f"kept for their size; fastest with {_name(fastest)} activations ({figures})",
        )
    return None, (
        f"{kind} weights are slower than the exact {_name(dtype)} path on this CPU "
        f'({figures}); use model.quantization = "none"'
    )


def activations_for(
    kind: str, config, dtype: torch.dtype, require_faster: bool = True
) -> tuple[torch.dtype | None, str]:
    """`choose_activations` timed on `config`'s widest decoder product (the stacked
    gate/up projection)."""
    timings = time_quantized_products(kind, config.hidden, 2 * config.intermediate, dtype)
    return choose_activations(kind, *timings, dtype, require_faster)
