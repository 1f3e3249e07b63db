"""What the Triton kernels share: lazy `triton.jit` (see the package docstring's "Modes"),
block sizes, layout and precision helpers, and the finite minus infinity of their softmaxes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

# Finite "minus infinity" for running maxima (no inf - inf anywhere); a constexpr, the only
# kind of global a compiled kernel may read.
NEG_BIG = tl.constexpr(-1.0e30)


class LazyJit:
    """`triton.jit(fn)`, made on first launch (and per interpreter setting)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._jitted: dict[bool, Any] = {}

    def jitted(self) -> Any:
        interpret = bool(triton.knobs.runtime.interpret)
        kernel = self._jitted.get(interpret)
        if kernel is None:
            kernel = self._jitted[interpret] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def pow2_block(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(max(int(n), 1)))


def last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for float32 operands (TF32 would cost ~1e-3); the default (which
    only concerns fp32) otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
