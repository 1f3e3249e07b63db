"""The output projection: hidden states -> float32 vocabulary logits.

Owns ``logits = hidden @ weight.T`` (optionally soft-capped) for a tied-embedding head such as
Gemma 3's 262144 x 640 one, which dominates a CPU decode step. Several CPU backends compute the
same product; ``LmHead`` picks one per batch-size bucket at construction.

Backends (all take a contiguous [N, H] input in the weight's dtype):

- ``aten``:   ``F.linear`` (MKL for fp32). Slow for this skinny, very wide shape on AMD CPUs.
- ``onednn``: oneDNN inner product on a weight reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``). Costs one extra copy of the weight.
- ``numpy``:  OpenBLAS sgemm through numpy on a zero-copy view of the weight (fp32 only).
- ``fp16``:   fbgemm's fp16 GEMM on an fp16 copy of the weight (`kernels.linear`'s fp16
  layout: fp32 activations and accumulation). Of an fp32 weight it is half the bytes and
  rounds the weights to fp16; of a bf16 weight it holds the same values (within fp16's
  normal range) in a copy fbgemm streams faster than oneDNN's bf16 kernel at a few rows,
  and its logits are rounded to bf16 as the bf16 products' are. Only when named (never
  picked by ``auto`` or ``calibrate``). A plan that names it may pair it with ``onednn``
  only, whose copy then holds the same values (fp16-rounded ones for an fp32 weight): a
  row's logits keep one precision whatever the batch it rides in.
- ``q8_0``: a GGUF's own Q8_0 blocks of the weight (`kernels.q8_0`: int8 values and an
  fp16 scale per 32, 1.0625 bytes a weight, through a C kernel with int16 activations). Given
  the blocks beside a plan naming ``fp16``, it takes every call the fp16 copy would, on a
  machine where the kernel builds with AVX2 or wider (a fixed rule: the same logits every
  start). An fp32 model's head then is the blocks' exact values narrow and wide (its oneDNN
  copy keeps the weight unrounded). A bf16 model's head is the blocks' exact values in
  narrow calls and their bf16 rounding in wide ones: a row's logits can differ by a bf16
  rounding between batch shapes (`bin/engine bench quality` measures the path).
- ``int8``, ``int4``: the weight quantized (``kernels.quant``: int8 per row, int4 per group
  of 32) and multiplied by torch's weight-only kernel with activations in
  ``quantized_activations`` (default: the weight's dtype); approximate, so only when asked
  for by name (never picked by ``auto`` or ``calibrate``).

``bin/engine bench lm_head`` times every backend at N = 1 / 8 / 32 on the machine at hand.
``backend="auto"`` uses oneDNN whenever it is available (a fixed plan, so logits are
bit-identical across restarts); ``backend="calibrate"`` times every backend at construction
and picks the fastest per bucket; a dict {bucket size: backend} is a plan given outright
(`fp16_plan`: the fp16 weights while few rows share them, where the step streams the
weight, and oneDNN's fp32 product beyond, where it computes).

Weights on another device (CUDA) use ``aten`` only (cuBLAS is fine there); fp16 is accepted
there too.

bf16 weights: the oneDNN and aten paths multiply bf16 x bf16 with fp32 accumulation and round
the logits to bf16 before widening them to float32 (as HF does in bf16); expect ~4e-3 relative
error against an fp32 product. fp32 weights match ``F.linear`` within 1e-5 relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.q8_0 import Q8_0Weight
from kernels.q8_0 import kernel as q8_0_kernel
from kernels.q8_0 import kernel_status as q8_0_kernel_status
from kernels.q8_0 import vectorized as q8_0_vectorized
from kernels.quant import QuantizedWeight
from kernels.timing import timed_runs

BACKENDS = ("aten", "onednn", "numpy", "fp16", "q8_0")
APPROXIMATE_BACKENDS = ("int8", "int4")
DEFAULT_CALIBRATION_SIZES = (1, 8, 32)
# fp16_plan's buckets: calls of up to ~22 rows (nearest in log scale to 16) take the fp16
# weights; wider calls take oneDNN's fp32 product, where its kernel computes faster than
# fbgemm's fp16 one (`bin/engine bench lm_head` shows where they cross on a machine).
FP16_PLAN_BUCKETS = (16, 32)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())


def narrow_fp16_plan() -> dict[int, str]:
    """The head of an ``onednn+fp16`` (bf16) model: the fp16 copy for calls of up to
    `kernels.linear.NARROW_ROWS` rows (nearest bucket: up to 5), oneDNN's bf16 beyond."""
    from kernels.linear import NARROW_ROWS

    return {NARROW_ROWS: "fp16", 2 * NARROW_ROWS: "onednn"}


def fp16_plan() -> dict[int, str]:
    """The head of an fp16-linear model (`model.linear = "fp16"`): the fp16 weights for
    narrow calls, oneDNN's fp32 product (when it runs here) for wide ones."""
    small, large = FP16_PLAN_BUCKETS
    return {small: "fp16", large: "onednn"} if onednn_available() else {small: "fp16"}


class LmHead:
    """Project hidden states [..., H] onto the vocabulary: float32 logits [..., V].

    ``weight`` [V, H] is used in place (no copy when it is contiguous), so a tied embedding
    shares its storage. At most one further copy is kept: the oneDNN-packed weight, and only
    when some bucket of the plan uses it. That copy is taken at construction: build a new head
    if the weight's values change afterwards.
    """

    def __init__(
        self,
        weight: Tensor,
        final_softcap: float | None = None,
        backend: str | dict[int, str] = "auto",
        calibration_sizes: Sequence[int] = DEFAULT_CALIBRATION_SIZES,
        quantized_activations: torch.dtype | None = None,
        quantized: QuantizedWeight | None = None,  # the approximate backend's weight, made
        # already (a loader read it straight from quantized blocks)
        q8_0: Q8_0Weight | None = None,  # the GGUF's own Q8_0 blocks of this weight
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"lm_head weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
        on_cpu = weight.device.type == "cpu"
        allowed = (
            (torch.float32, torch.bfloat16)
            if on_cpu
            else (torch.float32, torch.bfloat16, torch.float16)
        )
        if weight.dtype not in allowed:
            raise ValueError(
                f"lm_head weight must be one of {allowed} on {weight.device.type}, "
                f"got {weight.dtype}"
            )
        given_plan = dict(backend) if isinstance(backend, dict) else None
        named = set(given_plan.values()) if given_plan is not None else {backend}
        if not on_cpu and not named <= {"auto", "aten"}:
            raise ValueError(f"only the aten lm_head backend runs on {weight.device}")
        if final_softcap is not None and not final_softcap > 0:
            raise ValueError(f"final_softcap must be positive or None, got {final_softcap}")
        choices = (*BACKENDS, *APPROXIMATE_BACKENDS, "auto", "calibrate")
        if given_plan is not None:
            choices = BACKENDS
            if not given_plan or not all(isinstance(n, int) and n > 0 for n in given_plan):
                raise ValueError(f"a plan maps positive batch sizes to backends, got {backend}")
        unknown = sorted(named - set(choices))
        if unknown:
            raise ValueError(f"unknown lm_head backend {unknown[0]!r}; choose from {choices}")
        if "fp16" in named and not named <= {"fp16", "onednn", "q8_0"}:
            raise ValueError(f"a plan with fp16 may pair it with onednn only, got {backend}")
        if q8_0 is not None and q8_0.shape != tuple(weight.shape):
            raise ValueError(f"Q8_0 blocks of {q8_0.shape} for a {tuple(weight.shape)} weight")
        if "q8_0" in named and q8_0 is None:
            raise ValueError("the q8_0 lm_head backend needs the weight's Q8_0 blocks")
        if "q8_0" in named and q8_0_kernel() is None:
            raise RuntimeError(f"the Q8_0 kernel is unavailable: {q8_0_kernel_status()}")
        if (
            q8_0 is not None
            and given_plan is not None
            and "fp16" in named
            and "q8_0" not in named
            and q8_0_vectorized()
        ):
            # The blocks take every call the fp16 copy would: the kernel on AVX2 or wider
            # ran faster than the copy at 1 to 16 rows (docs/benchmarks.md). A fixed rule,
            # not a timing, so every engine on a machine computes the same logits.
            given_plan = {n: "q8_0" if name == "fp16" else name for n, name in given_plan.items()}
            named = set(given_plan.values())
        self._q8_0 = q8_0.packed() if "q8_0" in named else None  # in the kernel's layout
        # a stand-in of one element (stride 0) beside a quantized weight stays as it is
        self.weight = weight.detach() if quantized is not None else weight.detach().contiguous()
        self.final_softcap = final_softcap
        self._fp16 = self._pack_fp16() if "fp16" in named else None
        self._numpy_weight = (
            self.weight.numpy()
            if on_cpu and self.weight.dtype == torch.float32 and not self._released
            else None
        )
        self._packed = (
            self._pack_onednn(rounded_to_fp16="fp16" in named and weight.dtype == torch.float32)
            if on_cpu and named & {"auto", "calibrate", "onednn"}
            else None
        )
        if "onednn" in named and self._packed is None:
            raise RuntimeError("the oneDNN lm_head backend is not available on this machine")
        if "numpy" in named and self._numpy_weight is None:
            raise ValueError("the numpy lm_head backend needs a float32 weight")
        self._quantized: QuantizedWeight | None = None  # of an approximate backend
        if backend in APPROXIMATE_BACKENDS:
            self._quantized = quantized or QuantizedWeight(
                self.weight, backend, quantized_activations or self.weight.dtype
            )
        self._kernels: dict[str, Callable[[Tensor], Tensor]] = {
            "aten": self._aten,
            "onednn": self._onednn,
            "numpy": self._numpy,
            "fp16": self._fp16_kernel,
            "int8": self._quantized_kernel,
            "int4": self._quantized_kernel,
            "q8_0": self._q8_0_kernel,
        }

        # plan: bucket batch size -> backend name; a call uses the bucket nearest its N.
        self.plan: dict[int, str]
        if given_plan is not None:
            self.calibration_ms = {}
            self.plan = given_plan
        elif backend == "calibrate":
            self.calibration_ms = self._calibrate(calibration_sizes)
            self.plan = {
                n: min(times, key=times.__getitem__) for n, times in self.calibration_ms.items()
            }
        else:
            self.calibration_ms = {}
            chosen = backend if backend != "auto" else self._fixed_choice()
            self.plan = {1: chosen}
        if "onednn" not in self.plan.values():
            self._packed = None  # release the copies nobody uses
        if "fp16" not in self.plan.values():
            self._fp16 = None
        if "q8_0" not in self.plan.values():
            self._q8_0 = None

    def release_exact_weight(self) -> Tensor:
        """Let go of the full-precision weight of a head whose plan is quantized only (an
        untied head is not the embedding table: a Llama-8B-sized one is 1 GB in bf16).
        `weight` keeps its shape, dtype and device over one element; returns that stand-in
        for the model's own parameter."""
        if not set(self.plan.values()) <= set(APPROXIMATE_BACKENDS):
            raise ValueError(f"the lm_head plan {self.plan} still reads the exact weight")
        self.weight = self.weight.new_zeros(()).expand(self.weight.shape)
        self._numpy_weight = None
        return self.weight

    @property
    def _released(self) -> bool:
        """The weight is a stand-in (`release_exact_weight`, or given so beside a quantized
        weight): no exact backend can run."""
        return self.weight.dim() == 2 and self.weight.stride() == (0, 0)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def available_backends(self) -> list[str]:
        names = [] if self._released else ["aten"]
        if self._packed is not None:
            names.append("onednn")
        if self._numpy_weight is not None:
            names.append("numpy")
        if self._fp16 is not None:
            names.append("fp16")
        if self._q8_0 is not None:
            names.append("q8_0")
        return names

    def backend_for(self, n: int) -> str:
        """Backend the plan uses for a batch of ``n`` rows (nearest bucket in log scale)."""
        sizes = self.plan.keys()
        bucket = min(sizes, key=lambda s: (abs(math.log2(max(n, 1) / s)), -s))
        return self.plan[bucket]

    @torch.no_grad()
    def __call__(self, hidden: Tensor) -> Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden size {hidden.shape[-1]} != lm_head hidden size {self.hidden_size}"
            )
        leading = hidden.shape[:-1]
        rows = (
            hidden.reshape(-1, self.hidden_size)
            .to(device=self.weight.device, dtype=self.weight.dtype)
            .contiguous()
        )
        if rows.shape[0] == 0:
            return torch.empty(
                *leading, self.vocab_size, dtype=torch.float32, device=self.weight.device
            )
        logits = self._kernels[self.backend_for(rows.shape[0])](rows)
        if logits.dtype != torch.float32:
            logits = logits.float()
        if self.final_softcap is not None:
            cap = self.final_softcap
            logits.div_(cap).tanh_().mul_(cap)
        return logits.view(*leading, self.vocab_size)

    def run_backend(self, name: str, hidden: Tensor) -> Tensor:
        """Raw product through one named backend (no softcap, no dtype widening); for benches."""
        return self._kernels[name](hidden.to(self.weight.dtype).contiguous())

    # --- backends -------------------------------------------------------------------------

    def _aten(self, rows: Tensor) -> Tensor:
        return F.linear(rows, self.weight)

    def _onednn(self, rows: Tensor) -> Tensor:
        assert self._packed is not None
        return torch.ops.mkldnn._linear_pointwise(rows, self._packed, None, "none", [], "")

    def _fp16_kernel(self, rows: Tensor) -> Tensor:
        assert self._fp16 is not None
        logits = torch.ops.quantized.linear_dynamic_fp16(rows.float(), self._fp16)
        return logits if self.weight.dtype == torch.float32 else logits.to(self.weight.dtype)

    def _q8_0_kernel(self, rows: Tensor) -> Tensor:
        if self._q8_0 is None:
            raise RuntimeError(f"the Q8_0 kernel is unavailable: {q8_0_kernel_status()}")
        logits = self._q8_0.product(rows)
        return logits if self.weight.dtype == torch.float32 else logits.to(self.weight.dtype)

    def _quantized_kernel(self, rows: Tensor) -> Tensor:
        assert self._quantized is not None
        return self._quantized.product(rows)

    def _numpy(self, rows: Tensor) -> Tensor:
        assert self._numpy_weight is not None
        return torch.from_numpy(np.matmul(rows.numpy(), self._numpy_weight.T))

    # --- construction helpers -------------------------------------------------------------

    def _pack_onednn(self, rounded_to_fp16: bool = False) -> Tensor | None:
        """The weight (its fp16-rounded values when `rounded_to_fp16`) in oneDNN's layout;
        None where oneDNN does not run."""
        if not onednn_available():
            return None
        try:
            weight = self.weight.half().float() if rounded_to_fp16 else self.weight
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            probe = torch.zeros(1, self.hidden_size, dtype=self.weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except RuntimeError:
            return None
        return packed

    def _pack_fp16(self):
        """The weight in fp16, packed for fbgemm; where that cannot run, an error naming why."""
        from kernels.linear import check_fp16_range, fp16_linear_works

        if self.weight.device.type != "cpu" or self.weight.dtype not in (
            torch.float32,
            torch.bfloat16,
        ):
            raise ValueError("the fp16 lm_head backend takes a float32 or bfloat16 CPU weight")
        if not fp16_linear_works():
            raise ValueError("fbgemm's fp16 product does not run on this machine")
        check_fp16_range(self.weight, "the lm_head weight")
        return torch.ops.quantized.linear_prepack_fp16(self.weight.float(), None)

    def _fixed_choice(self) -> str:
        return "onednn" if self._packed is not None else "aten"

    def _calibrate(self, sizes: Sequence[int]) -> dict[int, dict[str, float]]:
        """Best-of-2 wall time (ms) of every available backend at each size, after a warmup."""
        generator = torch.Generator().manual_seed(0)
        results: dict[int, dict[str, float]] = {}
        for n in sorted(set(sizes)):
            rows = torch.randn(n, self.hidden_size, generator=generator).to(self.weight.dtype)
            times: dict[str, float] = {}
            for name in self.available_backends():
                kernel = self._kernels[name]
                times[name] = min(timed_runs(lambda: kernel(rows), 2)) * 1e3
            results[n] = times
        return results
