"""Weight-only int8 quantization for CPU decode (opt-in: `model.quantization = "int8"`).

A batch-1 decode step streams every weight once, so its speed is bytes per token: fp32
weights read 4 bytes a parameter, bf16 2, int8 1. Each linear layer's weight (and the LM
head's) is quantized per output channel, symmetric: w ~ q * scale with q in [-127, 127] and
scale = max |w_row| / 127 rounded to the dtype the kernel takes it in (so the rounding of
the scale is folded into q, not left as a per-channel error), and multiplied by torch's own
CPU kernel `torch._weight_int8pack_mm` (accumulation in float). The input embedding keeps
its full-precision table (a lookup reads one row).

The kernel's speed depends on the dtype of its activations, and not as the exact product's
does: with bf16 activations it beats the fp32 product even on an AVX2-only CPU, where bf16
matmuls are otherwise emulated; with fp32 activations it is several times slower than the
fp32 product. So the runner times int8 with each candidate activation dtype (the model's,
and bf16) against the exact product on the model's own shape (`time_int8_products`), runs
the products in the fastest one (`choose_int8_activations`; activations are rounded to it
for the product only, the rest of the model keeps its dtype) and refuses the mode, with the
timings, where no int8 product beats the exact one.

The default stays the exact path: `bin/engine bench quality` reports how far this mode's
greedy outputs and perplexity move from fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.timing import timed_runs


def quantize_rows(
    weight: Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """(int8 [out, in], scales [out] in `scale_dtype`) with weight ~ q * scales[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def int8_product(rows: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """rows [N, in] x int8 weight [out, in]: [N, out] in the input's dtype; the product runs
    with activations in the scales' dtype."""
    out = torch._weight_int8pack_mm(rows.to(scales.dtype), q, scales)
    return out.to(rows.dtype)


class Int8Linear(nn.Module):
    """`nn.Linear` (no bias or with one) over an int8 per-channel weight, its product run
    with activations in `activations` (default: the weight's dtype)."""

    def __init__(
        self,
        linear: nn.Module,  # nn.Linear or kernels.linear.OneDnnLinear
        activations: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scales = quantize_rows(linear.weight, activations or linear.weight.dtype)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        out = int8_product(x.reshape(-1, self.in_features).contiguous(), self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantize_linears(module: nn.Module, activations: torch.dtype | None = None) -> int:
    """Replace every `nn.Linear` (plain or oneDNN-packed) inside `module` by an
    `Int8Linear` computing with `activations`; returns how many."""
    from kernels.linear import OneDnnLinear

    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, OneDnnLinear)):
            # replaces the submodule of that name
            module.add_module(name, Int8Linear(child, activations))
            count += 1
        else:
            count += quantize_linears(child, activations)
    return count


def int8_supported(activations: torch.dtype = torch.float32) -> bool:
    """Whether torch's int8 weight-only matmul runs here with `activations`."""
    try:
        x = torch.zeros(1, 8, dtype=activations)
        scales = torch.ones(4, dtype=activations)
        torch._weight_int8pack_mm(x, torch.zeros(4, 8, dtype=torch.int8), scales)
    except (RuntimeError, AttributeError):
        return False
    return True


def time_int8_products(
    in_features: int, out_features: int, dtype: torch.dtype, rows: int = 1, repeats: int = 7
) -> tuple[dict[torch.dtype, float], float]:
    """Best-of-`repeats` seconds of one [rows, in] x [out, in] product: int8 with each
    activation dtype that runs here (`dtype`, bf16), and the exact `dtype` product."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    int8_s = {}
    for activations in dict.fromkeys((dtype, torch.bfloat16)):
        if int8_supported(activations):
            q, scales = quantize_rows(weight, activations)
            # One warm-up call each: kernel selection, first touch of the output.
            product = lambda q=q, scales=scales: int8_product(x, q, scales)  # noqa: E731
            int8_s[activations] = min(timed_runs(product, repeats))
    return int8_s, min(timed_runs(lambda: F.linear(x, weight), repeats))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def choose_int8_activations(
    int8_s: dict[torch.dtype, float], exact_s: float, dtype: torch.dtype
) -> tuple[torch.dtype | None, str]:
    """The activation dtype whose int8 product is fastest, if it beats the exact `dtype`
    product (else None), with the figures as the reason."""
    figures = ", ".join(
        [f"int8 with {_name(a)} activations {s * 1e6:.0f} us" for a, s in int8_s.items()]
        + [f"exact {_name(dtype)} {exact_s * 1e6:.0f} us per batch-1 product"]
    )
    fastest = min(int8_s, key=int8_s.__getitem__, default=None)
    if fastest is not None and int8_s[fastest] < exact_s:
        return (
            fastest,
            f"int8 weights are faster here with {_name(fastest)} activations ({figures})",
        )
    return None, (
        f"int8 weights are slower than the exact {_name(dtype)} path on this CPU ({figures}); "
        'use model.quantization = "none"'
    )


def int8_activations_for(config, dtype: torch.dtype) -> tuple[torch.dtype | None, str]:
    """`choose_int8_activations` timed on `config`'s widest decoder product (the stacked
    gate/up projection)."""
    timings = time_int8_products(config.hidden, 2 * config.intermediate, dtype)
    return choose_int8_activations(*timings, dtype)


def quantize_model(model: nn.Module, config, activations: torch.dtype):
    """Quantize `model`'s decoder linears in place; returns its int8 LM head (the executor's
    `lm_head`, over the tied embedding that keeps its full-precision table)."""
    from kernels.lm_head import LmHead

    quantize_linears(model.layers, activations)
    return LmHead(
        model.lm_head_weight,
        config.final_logit_softcap,
        backend="int8",
        int8_activations=activations,
    )
