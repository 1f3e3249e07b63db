"""Products on opaque packed weights, as an op `torch.compile` can put in a graph.

The CPU's packed linears (`kernels.linear`: fbgemm's fp16 packing, oneDNN's blocked layout)
hold their weight as an opaque object (a TorchScript object or an MKLDNN tensor) that
Dynamo cannot trace. Inside a compiled region such a module calls `packed_linear`, a custom
op that names the module by an integer handle and states the output's shape, so the graph
keeps the product as one call to the same kernel (`kernels.compiled_step`). Outside a
compiled region the modules call their kernel directly, at no cost. (A linear reading a
GGUF's blocks, in a graph whose width is fixed and narrow, calls their C++ operator
instead: `kernels.q8_0`, `Q8_0NarrowLinear.forward`.)

Handles are never reused; the registry holds modules weakly, so a dropped model's packed
weights are freed as before.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch
from torch import Tensor


class PackedProduct(Protocol):
    def product(self, rows: Tensor) -> Tensor: ...


_MODULES: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def register(module: PackedProduct) -> int:
    """A handle for `module` (its `product(rows [N, in]) -> [N, out]` is what the op runs)."""
    handle = next(_HANDLES)
    _MODULES[handle] = weakref.ref(module, lambda _: _MODULES.pop(handle, None))
    return handle


# The ops are declared by schema and given one kernel for every device
# (CompositeExplicitAutograd), not through `torch.library.custom_op`: its Python wrappers
# (autograd, Dynamo disabling) cost about 10 us a call, and a compiled step calls these ops
# once a layer (write_kv) and once a packed linear.
_LIB = torch.library.Library("kvactor", "FRAGMENT")
_PT2 = (torch.Tag.pt2_compliant_tag,)  # as custom_op tags its ops
_LIB.define("packed_linear(Tensor rows, int handle, int out_features) -> Tensor", tags=_PT2)
_LIB.define(
    "write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()",
    tags=_PT2,
)


def _packed_linear(rows: Tensor, handle: int, out_features: int) -> Tensor:
    """rows [N, in] -> [N, out_features] through the registered module's own kernel."""
    ref = _MODULES.get(handle)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(f"packed linear {handle} is gone (its model was dropped)")
    return module.product(rows)


def _write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v, in place: a compiled graph writes a layer's
    new K/V into the pool itself (traced as plain indexing, a write into a view of the pool
    becomes a copy of the whole pool)."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


_LIB.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
_LIB.impl("write_kv", _write_kv, "CompositeExplicitAutograd")


@torch.library.register_fake("kvactor::packed_linear", lib=_LIB)
def _(rows: Tensor, handle: int, out_features: int) -> Tensor:
    return rows.new_empty((rows.shape[0], out_features))


@torch.library.register_fake("kvactor::write_kv", lib=_LIB)
def _(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    return None


packed_linear = torch.ops.kvactor.packed_linear.default
write_kv = torch.ops.kvactor.write_kv.default


def product(module, rows: Tensor) -> Tensor:
    """`module.product(rows)`, as the custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return packed_linear(rows, module.handle, module.out_features)
    return module.product(rows)
