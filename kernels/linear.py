"""The decoder's linear layers: fused projections, and packed weights on the CPU.

Fused projections (as vLLM's and SGLang's stacked parameters): each attention block holds
one `qkv_proj` (q, k and v weights stacked along the output dimension, in that order) and
each MLP one `gate_up_proj` (gate, then up). Checkpoints name the parts separately;
`stack_projections` maps their tensors to the model's names when a model is built. One
product instead of three (or two) reads the same bytes with fewer, larger kernel calls.

Weight layouts for the CPU (`model.linear`), chosen once when a model is built:

* ``aten``: `F.linear` on the plain weight (MKL / oneDNN on the weight's own layout).
* ``onednn``: every decoder linear's weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the same path as `LmHead`'s oneDNN backend)
  and multiplied by `torch.ops.mkldnn._linear_pointwise`. fp32 results differ from
  `F.linear` by rounding only (a different summation order).
* ``fp16``: fp32 models only. Each weight is stored in fp16 and packed for fbgemm's fp16
  GEMM (`torch.ops.quantized.linear_prepack_fp16` / `linear_dynamic_fp16`, the kernel
  PyTorch ships for x86 servers), which widens the weights to fp32 in registers:
  activations, accumulation and outputs stay fp32. A decode step streams every weight
  once, so half the bytes is up to half the time where memory bandwidth bounds the step
  (batch 1); the only approximation is the weight's rounding to fp16's 11 significant bits
  (relative error <= 2^-11 for |w| >= 2^-14, 8 times finer than bf16's), except in the
  narrow calls that read a GGUF's blocks (below). A weight beyond fp16's range
  (|w| > 65504) is refused rather than saturated.

* ``onednn+fp16``: bf16 models only. Each weight twice: oneDNN-packed bf16 (as ``onednn``)
  for calls of more than `NARROW_ROWS` rows, and an fp16 copy packed for fbgemm for
  narrower ones: there a step streams every weight, and fbgemm streams it faster than
  oneDNN's bf16 kernel (`bin/engine bench model` shows both). fp16 holds every bf16 value
  in its normal range exactly (11 significant bits against 8; |w| < 2^-14 rounds to fp16's
  subnormals), the narrow product accumulates in fp32 and rounds its output to bf16 as the
  wide one does, so a row's result differs between the two by summation order only. Twice
  the decoder's weight bytes, and the LM head keeps an fp16 copy of its own
  (`kernels.lm_head.narrow_fp16_plan`); linears that read a GGUF's blocks (below) and a
  head that does hold no fp16 copy.

Where a GGUF stores a projection's parts in blocks `kernels.gguf_blocks` reads as int8
blocks (Q8_0, Q5_0, Q4_0, Q4_K, Q6_K: every linear of the embedded Gemma 3 270M), the
``fp16`` and ``onednn+fp16`` layouts give the calls of at most `NARROW_ROWS` rows to those
blocks instead (`Q8_0NarrowLinear`, `kernels.q8_0`): the file's own values at 1.0625 to 1.25
bytes a weight, activations rounded to 16 bits, where the fp16 copy reads 2 bytes of
rounded weights. Wider calls keep the layout's own weight (fbgemm's fp16 for an fp32
model, oneDNN's bf16 for a bf16 one, which then makes no fp16 copy of those linears). A
row's result can then differ between a narrow and a wide call by the wide weight's rounding
(fp16's or bf16's) and the activations' (2^-16 of a block's largest), as the head's
(`kernels.lm_head`); tests/model/test_batch_invariance.py checks greedy output alone and
in a batch of 24 on the embedded model.

The plain weight is dropped after packing (`.weight` rebuilds a plain copy on demand), so
memory stays one copy. A tied LM head keeps the fp32 table for the embedding lookup and
adds an fp16 copy plus oneDNN's copy of the same rounded values (`kernels.lm_head.fp16_plan`;
1 GB more for Gemma 3's 262144 x 640 head).

``auto`` (`choose_linear_backend`), on the CPU: ``fp16`` for an fp32 model where fbgemm
runs it (CPUs without native bf16 get fp32 from `model.dtype = "auto"`, and there bf16
products are emulated, so fp16 storage is the half-width format that runs at full speed);
for a bf16 model on a CPU with native bf16, ``onednn+fp16`` (``onednn`` where fp16 cannot
hold a weight or fbgemm does not run); ``aten`` otherwise. `bin/engine bench model
--linear ...` and `bin/engine bench quality --modes fp32,fp16` measure a machine's choice.
"""

from __future__ import annotations

from functools import cache
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kernels import graph_ops


class BlockProduct(Protocol):
    """A weight's blocks in a kernel's layout (`kernels.q8_0.Q8_0Packed`; named by shape,
    not imported: the kernel's module reaches the loader, which reaches this one)."""

    rows: int
    hidden: int

    def product(self, rows: Tensor) -> Tensor: ...

    @property
    def traceable(self) -> bool: ...  # `linear` is one op a compiled graph can hold

    def linear(self, rows: Tensor, bias: Tensor | None = None) -> Tensor: ...


# fused module name -> its parts, in the order their outputs are stacked
STACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
LINEAR_BACKENDS = ("aten", "onednn", "fp16", "onednn+fp16")
FP16_MAX = 65504.0  # the largest finite fp16
# onednn+fp16: calls of at most this many rows take the fp16 copy. Measured on an AVX-512
# bf16 CPU with Gemma 3 270M's decoder (weights streamed from memory): fbgemm's fp16 product
# is ahead of oneDNN's bf16 one up to 4 rows and behind from 8.
NARROW_ROWS = 4


def decoder_linear(name: str) -> str | None:
    """`layers.3.self_attn.q_proj.weight` -> `layers.3.self_attn.q_proj` for the weight of a
    decoder linear (a projection inside a layer); None for anything else (norms, embeddings,
    biases, the LM head)."""
    if name.startswith("layers.") and name.endswith("_proj.weight"):
        return name.removesuffix(".weight")
    return None


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
        self.handle = graph_ops.register(self)

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

    def product(self, rows: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")

    def forward(self, x: Tensor) -> Tensor:
        out = graph_ops.product(self, x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)


class Fp16Linear(nn.Module):
    """`nn.Linear` (fp32) on an fp16 copy of its weight, packed for fbgemm (CPU only);
    activations, accumulation and output in fp32."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        if weight.dtype != torch.float32:
            raise ValueError(f"fp16 linears take fp32 layers, got {weight.dtype}")
        check_fp16_range(weight, "a linear weight")
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        # An opaque fbgemm object: kept as a plain attribute, as OneDnnLinear's.
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.contiguous(), self.bias)
        self.weight_bytes = weight.numel() * 2
        self.handle = graph_ops.register(self)

    @property
    def weight(self) -> Tensor:
        """A plain fp32 [out, in] copy of the weight as stored (rounded to fp16)."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    def __deepcopy__(self, memo: dict) -> Fp16Linear:
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        plain.weight = nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return Fp16Linear(plain)

    def product(self, rows: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)

    def forward(self, x: Tensor) -> Tensor:
        out = graph_ops.product(self, x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)


class _NarrowOverWide(nn.Module):
    """A linear with a copy of its own for narrow calls over `self.wide`, a packed layout
    that holds the weight (and bias) the module reports and serves the wide calls."""

    wide: nn.Module
    in_features: int
    out_features: int

    @property
    def weight(self) -> Tensor:
        return self.wide.weight

    @property
    def bias(self) -> Tensor | None:
        return self.wide.bias

    def forward(self, x: Tensor) -> Tensor:
        out = graph_ops.product(self, x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)


class NarrowFp16Linear(_NarrowOverWide):
    """A bf16 `nn.Linear` held twice (the ``onednn+fp16`` layout, see the module doc):
    oneDNN-packed bf16 for calls of more than `NARROW_ROWS` rows, an fp16 copy packed for
    fbgemm for narrower ones. Inputs and outputs are bf16 either way."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"onednn+fp16 linears take bf16 layers, got {weight.dtype}")
        check_fp16_range(weight, "a linear weight")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.wide = OneDnnLinear(linear)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        # An opaque fbgemm object (as Fp16Linear's); `weight_bytes` counts it.
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), bias)
        self.weight_bytes = weight.numel() * 2
        self.handle = graph_ops.register(self)

    def __deepcopy__(self, memo: dict) -> NarrowFp16Linear:
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        plain = plain.to(torch.bfloat16)
        plain.weight = nn.Parameter(self.weight, requires_grad=False)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return NarrowFp16Linear(plain)

    def product(self, rows: Tensor) -> Tensor:
        if rows.shape[0] > NARROW_ROWS:
            return self.wide.product(rows)
        out = torch.ops.quantized.linear_dynamic_fp16(rows.float(), self.packed)
        return out.to(rows.dtype)


class Q8_0NarrowLinear(_NarrowOverWide):
    """A decoder linear whose weight its GGUF stores in blocks read as int8 blocks
    (`kernels.gguf_blocks`): calls of at most `NARROW_ROWS` rows multiply those blocks
    (`kernels.q8_0`: the file's own values, 1.0625 to 1.375 bytes a weight), wider ones `wide`, the
    layout's own packed weight (`OneDnnLinear` for a bf16 model, `Fp16Linear` for an fp32
    one). The blocks take the calls an fp16 copy would, so a bf16 model makes none."""

    def __init__(self, wide: nn.Module, blocks: BlockProduct) -> None:
        super().__init__()
        if (blocks.rows, blocks.hidden) != (wide.out_features, wide.in_features):
            raise ValueError(
                f"blocks of [{blocks.rows}, {blocks.hidden}] for a "
                f"[{wide.out_features}, {wide.in_features}] linear"
            )
        self.in_features = wide.in_features
        self.out_features = wide.out_features
        self.wide = wide
        self.blocks = blocks
        self.handle = graph_ops.register(self)

    def __deepcopy__(self, memo: dict) -> Q8_0NarrowLinear:
        # the wide layout's own copy (each packed form has one); the blocks are read-only
        return Q8_0NarrowLinear(self.wide.__deepcopy__(memo), self.blocks)

    def forward(self, x: Tensor) -> Tensor:
        # A graph whose width is fixed and narrow (one row: batch-1 decode) holds the blocks'
        # operator itself: no custom op calling back into Python. A symbolic width is never
        # narrow here (a guard on it would go unchecked: compiled_step). Eager calls go
        # straight to the shared path.
        if torch.compiler.is_compiling() and self.blocks.traceable:
            rows = x.reshape(-1, self.in_features)
            if statically_known_true(rows.shape[0] <= NARROW_ROWS):
                out = self.blocks.linear(rows, self.bias)
                return out.view(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def product(self, rows: Tensor) -> Tensor:
        if rows.shape[0] > NARROW_ROWS:
            return self.wide.product(rows)
        return self.blocks.linear(rows, self.bias)


def check_fp16_range(weight: Tensor, what: str) -> None:
    """Refuse a weight fp16 cannot hold (fbgemm would saturate it silently)."""
    largest = _largest_magnitude(weight)
    if not largest <= FP16_MAX:  # also catches NaN
        raise ValueError(
            f"{what} holds |w| = {largest:g}, beyond fp16's range ({FP16_MAX:g}); "
            'use model.linear = "aten"'
        )


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


@cache
def fp16_linear_works() -> bool:
    """Whether fbgemm's fp16 linear runs on this CPU (probed once)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        linear = nn.Linear(16, 8, bias=True)
        x = torch.randn(3, 16)
        got = Fp16Linear(linear)(x)
        want = nn.functional.linear(x, linear.weight.half().float(), linear.bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))


def _largest_magnitude(weight: Tensor) -> float:
    """max |w| (NaN if any is NaN) without a temporary the size of `weight`."""
    if not weight.numel():
        return 0.0
    return max(float(weight.max()), -float(weight.min()))


def fits_fp16(weights) -> bool:
    """Whether every tensor of `weights` lies within fp16's range."""
    return all(_largest_magnitude(w.detach()) <= FP16_MAX for w in weights)


def choose_linear_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    weights=None,
    native_bf16: bool | None = None,
) -> tuple[str, str]:
    """The decoder linears' backend for `requested` (a name or "auto") and why; what this
    machine cannot run is an error naming why. `weights` (the tensors to be packed), when
    given, lets "auto" keep aten for weights fp16 cannot hold. `auto` on the CPU: fp16
    weights for an fp32 model; oneDNN-packed weights for a bf16 model where the CPU
    multiplies bf16 natively (`native_bf16`, default: this CPU's), F.linear otherwise."""
    if requested not in (*LINEAR_BACKENDS, "auto"):
        raise ValueError(
            f"linear backend must be auto or one of {LINEAR_BACKENDS}, got {requested!r}"
        )
    if requested == "auto":
        if device.type != "cpu":
            return "aten", f"auto: aten on {device.type}"
        if dtype == torch.bfloat16:
            if native_bf16 is None:
                from kernels.cpu import cpu_features

                native_bf16 = cpu_features().native_bf16
            if native_bf16 and onednn_linear_works(dtype):
                if not fp16_linear_works():
                    return "onednn", "auto: bf16 model, native bf16 CPU, no fbgemm fp16"
                if weights is not None and not fits_fp16(weights):
                    return "onednn", "auto: bf16 model, a weight is beyond fp16's range"
                return "onednn+fp16", (
                    "auto: bf16 model, native bf16 CPU: oneDNN-packed weights, fp16 copies "
                    f"for steps of at most {NARROW_ROWS} rows"
                )
        if dtype != torch.float32:
            return "aten", f"auto: aten for a {_name(dtype)} model"
        if not fp16_linear_works():
            return "aten", "auto: fbgemm's fp16 linear does not run here"
        if weights is not None and not fits_fp16(weights):
            return "aten", "auto: a weight is beyond fp16's range"
        return "fp16", "auto: fp32 model on the CPU: weights stored in fp16 (half the bytes)"
    if requested == "aten":
        return "aten", "set in the config"
    if device.type != "cpu":
        raise ValueError(f"the {requested} linear backend is a CPU path, not {device}")
    if requested in ("onednn", "onednn+fp16") and not onednn_linear_works(dtype):
        raise ValueError(f"oneDNN cannot run {_name(dtype)} linears on this CPU; use aten")
    if requested == "onednn+fp16":
        if dtype != torch.bfloat16:
            raise ValueError(f"onednn+fp16 linears need a bf16 model, not {_name(dtype)}")
        if not fp16_linear_works():
            raise ValueError("fbgemm's fp16 linear does not run on this CPU; use onednn")
    if requested == "fp16":
        if dtype != torch.float32:
            raise ValueError(f"fp16 linears need an fp32 model, not {_name(dtype)}; use aten")
        if not fp16_linear_works():
            raise ValueError("fbgemm's fp16 linear does not run on this CPU; use aten")
    return requested, "set in the config"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


PACKED_LINEARS: dict[str, type[nn.Module]] = {
    "onednn": OneDnnLinear,
    "fp16": Fp16Linear,
    "onednn+fp16": NarrowFp16Linear,
}


# every packed form of a linear (what `kernels.quant.quantize_linears` also replaces)
PACKED_FORMS: tuple[type[nn.Module], ...] = (*PACKED_LINEARS.values(), Q8_0NarrowLinear)
# layouts whose narrow calls Q8_0 blocks may take (each holds its weight approximately there)
BLOCK_LAYOUTS: dict[str, type[nn.Module]] = {"fp16": Fp16Linear, "onednn+fp16": OneDnnLinear}


def pack_linears(
    module: nn.Module,
    backend: str = "onednn",
    blocks: dict[str, BlockProduct] | None = None,
    prefix: str = "",
) -> int:
    """Replace every `nn.Linear` inside `module` by its `backend` form (`OneDnnLinear`,
    `Fp16Linear`, `NarrowFp16Linear`); returns how many. `blocks`: Q8_0 blocks of some
    linears by module name (`prefix` + the name inside `module`), for a layout of
    `BLOCK_LAYOUTS`: those become `Q8_0NarrowLinear`s over that layout's wide form."""
    packed = PACKED_LINEARS[backend]
    blocks = blocks or {}
    if blocks and backend not in BLOCK_LAYOUTS:
        raise ValueError(f"Q8_0 blocks go with the {sorted(BLOCK_LAYOUTS)} layouts, not {backend}")
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            given = blocks.get(prefix + name)
            if given is None:
                replacement = packed(child)
            else:
                replacement = Q8_0NarrowLinear(BLOCK_LAYOUTS[backend](child), given)
            module.add_module(name, replacement)  # replaces the submodule of that name
            count += 1
        else:
            count += pack_linears(child, backend, blocks, f"{prefix}{name}.")
    return count
