"""Weight-only int8 quantization for CPU decode (opt-in: `model.quantization = "int8"`).

A batch-1 decode step streams every weight once, so its speed is bytes per token: fp32
weights read 4 bytes a parameter, bf16 2, int8 1. Each linear layer's weight (and the LM
head's) is quantized per output channel, symmetric: w ~ q * scale with q in [-127, 127] and
scale = max |w_row| / 127, and multiplied by torch's own CPU kernel
`torch._weight_int8pack_mm` (activations stay in the model's dtype, accumulation in
float). The input embedding keeps its full-precision table (a lookup reads one row).

The default stays the exact path: `bin/engine bench quality` reports how far this mode's
greedy outputs and perplexity move from fp32.

The mode only pays where torch's int8 kernel is fast for the activation dtype: with bf16
activations on a CPU with native bf16 it beats the bf16 product; with float32 activations
it was measured about 5x slower than the float32 product (8 x 640 x 2048). So the runner
times both on the model's own shape before it quantizes (`int8_pays_off`) and refuses the
mode, with the two timings, where int8 is not the faster one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.timing import timed_runs


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(int8 [out, in], scales [out] in float32) with weight ~ q * scales[:, None]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(nn.Module):
    """`nn.Linear` (no bias or with one) over an int8 per-channel weight."""

    def __init__(self, linear: nn.Module) -> None:  # nn.Linear or kernels.linear.OneDnnLinear
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dtype = linear.weight.dtype
        q, scales = quantize_rows(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
        out = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


def quantize_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` (plain or oneDNN-packed) inside `module` by an
    `Int8Linear`; returns how many."""
    from kernels.linear import OneDnnLinear

    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, OneDnnLinear)):
            module.add_module(name, Int8Linear(child))  # replaces the submodule of that name
            count += 1
        else:
            count += quantize_linears(child)
    return count


def int8_supported() -> bool:
    """Whether torch's int8 weight-only matmul runs here."""
    try:
        x = torch.zeros(1, 8)
        torch._weight_int8pack_mm(x, torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
    except (RuntimeError, AttributeError):
        return False
    return True


def time_int8_and_exact(
    in_features: int, out_features: int, dtype: torch.dtype, rows: int = 1, repeats: int = 7
) -> tuple[float, float]:
    """Best-of-`repeats` seconds of one [rows, in] x [out, in] product: (int8, exact `dtype`)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    q, scales = quantize_rows(weight)
    scales = scales.to(dtype)

    # One warm-up call each: kernel selection, first touch of the output.
    return (
        min(timed_runs(lambda: torch._weight_int8pack_mm(x, q, scales), repeats)),
        min(timed_runs(lambda: F.linear(x, weight), repeats)),
    )


def int8_pays_off(int8_s: float, exact_s: float, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether int8 weights beat the exact `dtype` product, with the figures as the reason."""
    name = str(dtype).removeprefix("torch.")
    figures = f"int8 {int8_s * 1e6:.0f} us vs {name} {exact_s * 1e6:.0f} us per batch-1 product"
    if int8_s < exact_s:
        return True, f"int8 weights are faster here ({figures})"
    return False, (
        f"int8 weights are slower than the exact {name} path on this CPU ({figures}); "
        'use model.quantization = "none"'
    )
