"""Small forward steps as one compiled graph (CPU): no Python between a step's ops.

At small batch a CPU decode step is about a thousand small torch ops (norms, rotary,
activations, the paged K/V gather, attention) between the weight products, and the Python
and dispatch between them cost as much as the products themselves. `CompiledStep` traces
the model body once with `torch.compile` (Inductor's C++ code on the CPU), which fuses the
small ops into a few loops and calls the products' own kernels (packed CPU linears through
`kernels.graph_ops`; in the one-row graph, a GGUF's blocks through their C++ operator,
`kvactor::q8_0_linear`, as a node of its own).

The graph is token-major: row t of a step is one new token, with its own key lanes (the
slots of its request's positions up to its own; on sliding layers only those its window
reaches) and a mask. So one graph serves decode rows, draft-verification rows and short
prefill chunks alike, and the K/V gather and the sliding-window map (`KVCache.sliding_slots`)
are inside it. The row count T and the lane counts L (full) and Ls (sliding) are symbolic:
two compiles serve every batch and context. Invariants the callers rely on:

- Two graphs: one row (T = 1: a padding row would cost more than a graph, the products
  being slower at two rows than at one) and T >= 2 rows. L, Ls >= 2: a size of 1 would be
  a specialization of its own, i.e. a recompile in the serving thread.
- A padding lane indexes slot 0 (the pool's reserved padding slot) and is masked out.
- A step whose rows would gather MAX_EXTRA_GATHER_BYTES more K/V than the eager path
  (`extra_gather_bytes`: rows sharing a long context each gather all of it) runs eagerly.
- Serving never compiles: after `compile()` the stance is "fail on recompile", and a step
  `known` refuses, whose shapes would need a new graph, runs eagerly instead (counted).
- Dynamo's guards (some 1,500 checks a graph on the model's modules and the inputs) are not
  evaluated for a step whose inputs `CompiledStep.known` accepts: each tensor of the dtype,
  device, rank and layout the graphs were compiled for, lanes >= 2, and the executor's
  model and KV pool the same objects, and the inputs' shapes consistent with each other
  (one row count; each mask [T, 1, 1, lanes] with its slots' lanes). Any other step is
  checked in full, and runs eagerly where a guard fails. A module swapped inside the model
  after compiling would go unseen: nothing does that.
- A known step does not enter Dynamo at all: it calls the code Dynamo produced for its
  graph (one row, or two and more, chosen by its row count) directly, as vLLM's compiled
  models dispatch to their captured code. Even with the guards skipped, Dynamo's lookup
  cost a few hundred microseconds a step, Python on the step's critical path. That code is
  taken from Dynamo's cache right after each warm-up compile and checked to give the
  guarded call's result on both warm-ups. Where the capture or the check fails (the reason
  is kept in `direct_failed`), known steps go through Dynamo with its guards skipped
  except those that tell the two graphs apart and those it keeps by default (the inputs'
  own checks, shape ranges, global state): `skip_guard_eval_unsafe`, torch 2.13; vLLM's
  compiled models skip guards once warmed up too.

Compiled code is cached on disk (Inductor's FX graph cache) under `cache_root()`: one folder
per torch version and CPU (capability and flags), so a restart traces the graph again but
does not recompile it. The folder is set when compiling, whatever TORCHINDUCTOR_CACHE_DIR
held: Inductor's own cache key omits the vector ISA it generated code for, so a shared folder
served AVX-512 code, built with AVX2 flags, to an AVX2 process (wrong logits, not an error).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kernels.attention.base import AttentionMetadata
from kernels.attention.torch_ref import _attend
from kernels.forward_context import ForwardContext
from kernels.graph_ops import write_kv

COMPILE_MODES = ("auto", "on", "off")
# Steps of more new tokens than this run eagerly: the fixed costs a graph removes shrink
# against the products as rows grow (`bin/engine bench model --compile` measures it).
DEFAULT_MAX_TOKENS = 32
# ... and steps whose rows would gather this many bytes of K/V more than the eager path:
# every row gathers its own padded key lanes, so a prefill chunk over a long cached context
# (each of its rows the whole context) costs the graph far more memory traffic than the
# Python it saves. Gemma 3 270M's steps stay under it (draft rows at a full context gather
# about 0.3 GiB more, and the graph still pays there); a model with 128 KiB of KV a token
# extending a 3,300-token context by 6 rows would gather 2.5 GiB more.
MAX_EXTRA_GATHER_BYTES = 512 << 20
_INSTANCES = itertools.count(1)
# Inductor's options for the step graphs. Its generated wrapper checks every extern kernel's
# output size and stride, and its inputs' alignment, in Python on each call (some 380
# checks a one-row step of Gemma 3 270M): debugging aids, off here (`known` checks the
# inputs' shapes; tests/model/test_compiled_step.py compares the graphs with eager steps).
GRAPH_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
_CACHE_FOLDER_LOCK = threading.Lock()


# CPU capabilities (torch's dispatch level) the compiled steps are verified on; others
# (no AVX2) serve eagerly.
VERIFIED_CAPABILITIES = ("AVX512", "AVX2")


def compile_verified_here() -> bool:
    return torch.backends.cpu.get_cpu_capability() in VERIFIED_CAPABILITIES


def compile_choice(
    requested: str, device: str, dtype: torch.dtype, linear: str, verified: bool | None = None
) -> tuple[bool, str]:
    """Whether the runner compiles its small steps, and why. `auto`: on the CPU, except on
    the exact path (float32 with aten linears), whose logits must stay those of eager mode
    (a compiled graph sums in another order: differences of ~1e-5), and except on a CPU
    capability the compiled steps are not verified on (`verified`, default: this CPU's)."""
    if requested not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {requested!r}")
    if requested == "off":
        return False, "set in the config"
    if device != "cpu":
        if requested == "on":
            raise ValueError("model.compile = on is a CPU path (CUDA steps replay CUDA graphs)")
        return False, f"auto: {device} replays CUDA graphs instead"
    if not (compile_verified_here() if verified is None else verified):
        why = (
            f"compiled steps are verified on {', '.join(VERIFIED_CAPABILITIES)} CPUs only, "
            f"this one dispatches {torch.backends.cpu.get_cpu_capability()}"
        )
        if requested == "on":
            raise ValueError(f"model.compile = on: {why}")
        return False, f"auto: {why}; eager"
    if requested == "on":
        return True, "set in the config"
    if dtype == torch.float32 and linear == "aten":
        return False, "auto: the exact path (float32, aten linears) stays eager"
    return True, "auto: CPU, not the exact path"


def use_cache_root() -> None:
    """Point Inductor at `cache_root()` for the rest of the process. Not setdefault:
    Inductor writes its default folder into the environment the first time anything asks
    for it; and not only while compiling: two executors compiling at once must not see
    the folder restored under them (see the module doc)."""
    root = str(cache_root())
    with _CACHE_FOLDER_LOCK:
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != root:
            from torch._inductor.utils import clear_caches

            os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
            clear_caches()  # paths memoized from the previous folder


def cache_root() -> Path:
    """Where compiled code is kept: the kvactor cache, per torch version and CPU."""
    from kernels.cpu import cpu_features
    from kernels.gguf_loader import kvactor_cache_dir

    f = cpu_features()
    flags = hashlib.sha256(" ".join(sorted(f.flags)).encode()).hexdigest()[:12]
    version = torch.__version__.replace("+", "-")
    return kvactor_cache_dir() / "inductor" / f"torch-{version}-{f.capability}-{flags}"


@dataclass(frozen=True)
class StepInputs:
    """A step's tensors in the graph's layout (T rows, L / Ls key lanes)."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    out_slots: Tensor  # int64 [T]: where each row's K/V is written
    full_slots: Tensor  # int64 [T, L]
    full_mask: Tensor  # bool [T, 1, 1, L]
    sliding_slots: Tensor  # int64 [T, Ls], full-pool slots (mapped inside the graph)
    sliding_mask: Tensor  # bool [T, 1, 1, Ls]

    def as_args(self) -> tuple[Tensor, ...]:
        return (
            self.input_ids,
            self.positions,
            self.out_slots,
            self.full_slots,
            self.full_mask,
            self.sliding_slots,
            self.sliding_mask,
        )


def key_lanes(
    kv_start: np.ndarray, positions: np.ndarray, window: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: flat indices into the step's `kv_indices` of its keys, and which lanes are
    real, for full and sliding layers. Row t's request starts at `kv_start[t]`; the row is
    at `positions[t]` and attends positions 0 .. p (full) or p - window + 1 .. p (sliding).
    Padded lanes index 0 and are masked; every array has at least 2 lanes."""
    count = positions + 1
    skip = np.zeros_like(count) if window is None else np.maximum(count - window, 0)

    def lanes(first: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        width = max(int(length.max()), 2)
        lane = np.arange(width, dtype=np.int64)
        valid = lane[None, :] < length[:, None]
        return np.where(valid, (kv_start + first)[:, None] + lane[None, :], 0), valid

    full, full_valid = lanes(np.zeros_like(count), count)
    sliding, sliding_valid = lanes(skip, count - skip)
    return full, full_valid, sliding, sliding_valid


def extra_gather_bytes(extend: np.ndarray, seq: np.ndarray, config, kv_elem_bytes: int) -> int:
    """K/V bytes the graph's per-row key lanes (`key_lanes`) gather beyond what the eager
    path does (each request's keys once, its prefill rows sharing them); `extend`, `seq`:
    per request, new tokens and context length. A lower bound for eager (it pads decode
    groups too), so an upper bound for the extra."""
    rows = int(extend.sum())
    lane = 2 * config.num_kv_heads * config.head_dim * kv_elem_bytes  # K and V, one layer
    sliding = len(config.sliding_layers)
    full = config.num_layers - sliding
    extra = full * max(rows * max(int(seq.max()), 2) - int(seq.sum()), 0)
    if sliding:
        seen = np.minimum(seq, config.sliding_window)
        extra += sliding * max(rows * max(int(seen.max()), 2) - int(seen.sum()), 0)
    return extra * lane


class _TokenAttention:
    """The graph's attention: each row attends its own key lanes (`StepInputs`)."""

    def __init__(self, shape, kv_cache, out_slots, keys) -> None:
        self.shape = shape
        self.out_slots = out_slots
        # is_sliding -> (slots in that layer's pool, mask)
        self.keys = keys

    def forward(self, layer_id, q, k, v, kv_cache, is_sliding):
        k_all, v_all = kv_cache.layer_kv(layer_id)
        slots = self.out_slots
        if layer_id in kv_cache.sliding:
            slots = kv_cache.sliding_slots(slots)
        write_kv(k_all, v_all, slots, k, v)
        slots, mask = self.keys[is_sliding]
        s = self.shape
        rows = q.shape[0]
        grouped = q.view(rows, s.num_kv_heads, s.group_size, s.head_dim)
        keys = k_all[slots].transpose(1, 2)  # [T, Hkv, L, D]
        values = v_all[slots].transpose(1, 2)
        out = _attend(grouped, keys, values, mask, s.scale, s.logit_softcap, 1)
        return out.reshape(rows, s.num_q_heads, s.head_dim)


class CompiledStep:
    """The compiled body of an executor's small steps; `ready` once compiled."""

    def __init__(self, executor, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.executor = executor
        self.max_tokens = max_tokens
        self.ready = False
        self.failed: str | None = None
        self.compile_s: float | None = None
        # the compiled kernels' OpenMP team size is fixed when they are generated: the
        # executor's thread count (this is built on the thread that runs its steps)
        self.threads = torch.get_num_threads()
        self.steps = 0  # steps run through the graph
        self.fallbacks = 0  # steps that would have recompiled and ran eagerly instead
        self.guarded = 0  # steps whose inputs `known` refused: Dynamo's guards checked them
        self._compiled = None
        self._traced_for: tuple | None = None  # what `known` compares a step's inputs with
        # Dynamo's code for each graph, called without Dynamo (see the module doc): index 0
        # the one-row graph, 1 the graph of two and more rows; None: not captured
        self._direct: tuple | None = None
        self.direct_failed: str | None = None  # why not, where compiled but not captured
        self.direct_by_graph = [0, 0]  # steps that called it: the one-row graph, the wider

    # -- the body, traced --------------------------------------------------------------
    def body(self, input_ids, positions, out_slots, full_slots, full_mask, sl_slots, sl_mask):
        """Final-norm hidden states [T, hidden] of every row; writes the rows' K/V."""
        ex = self.executor
        rope = {t: cache.cos_sin(positions, ex.dtype) for t, cache in ex.rotary.items()}
        keys = {
            False: (full_slots, full_mask),
            True: (ex.kv_cache.sliding_slots(sl_slots), sl_mask),
        }
        attention = _TokenAttention(ex.shape, ex.kv_cache, out_slots, keys)
        ctx = ForwardContext(attention=attention, kv_cache=ex.kv_cache, rope=rope)
        return ex.model(input_ids, ctx, None)

    # -- compiling ---------------------------------------------------------------------
    def compile(self) -> None:
        """Trace and compile the body (minutes cold; seconds from the disk cache). Safe to
        call from a background thread while the executor serves eagerly: until `ready`,
        nothing routes to the graph. A failure leaves eager serving as it was."""
        import torch._dynamo

        start = time.perf_counter()
        torch.set_num_threads(self.threads)  # this thread's own count (see __init__)
        try:
            use_cache_root()
            with torch.inference_mode():
                body = self._own_body()
                compiled = torch.compile(body, fullgraph=True, options=GRAPH_OPTIONS)
                codes = {}
                # rows symbolic (>= 2), then one row: a graph of its own (see the module doc)
                for rows in (3, 1):
                    before = _dynamo_codes(body) or []
                    args = self._warmup_inputs(rows).as_args()
                    lane_dims = ((), (), (), (1,), (3,), (1,), (3,))
                    for tensor, dims in zip(args, lane_dims):
                        for dim in (*dims, 0) if rows > 1 else dims:
                            torch._dynamo.mark_dynamic(tensor, dim)
                    compiled(*args)
                    after = _dynamo_codes(body) or []
                    new = [c for c in after if all(c is not b for b in before)]
                    codes[rows > 1] = new[0] if len(new) == 1 else None
                self._compiled = compiled
                self._traced_for = (ex_state(self.executor), _layouts(args))
                self._direct, self.direct_failed = self._checked_direct(body, codes)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves eager mode
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return
        self.compile_s = time.perf_counter() - start
        self.ready = True

    @property
    def direct_steps(self) -> int:
        """Steps that called Dynamo's code directly, both graphs together."""
        return sum(self.direct_by_graph)

    @property
    def direct_ready(self) -> bool:
        """Whether known steps call Dynamo's code directly (see the module doc)."""
        return self._direct is not None

    def _checked_direct(self, body, codes: dict) -> tuple[tuple | None, str | None]:
        """(Dynamo's code for each graph as plain functions, None) where both were captured
        and each gives the guarded call's result on fresh warm-up inputs; else (None, why).
        Never raises: without the bypass the compiled steps still serve."""
        if codes.get(False) is None or codes.get(True) is None:
            return None, "Dynamo's code for each graph not found in its cache"
        try:
            func = body.__func__
            direct = tuple(types.FunctionType(codes[i], func.__globals__) for i in (False, True))
            for rows in (1, 3):
                # as `compile` traced them: inference tensors, in inference mode
                with torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode():
                    args = self._warmup_inputs(rows).as_args()
                    guarded = self._compiled(*args)
                    bypassed = direct[rows > 1](self, *args)
                if not torch.equal(bypassed, guarded):
                    return None, f"the captured {rows}-row graph differs from the guarded call"
        except Exception as exc:  # noqa: BLE001 - a private API's change costs only the bypass
            return None, f"{type(exc).__name__}: {exc}"
        return direct, None

    def _own_body(self):
        """`body` bound to this instance through a code object of its own: Dynamo keeps its
        compiled graphs per code object, and one executor's graphs must never be tried
        (or counted against the recompile limit) for another's."""
        code = CompiledStep.body.__code__.replace(co_name=f"body_{next(_INSTANCES)}")
        return types.MethodType(types.FunctionType(code, CompiledStep.body.__globals__), self)

    def _warmup_inputs(self, rows: int) -> StepInputs:
        """Padding rows only (slot 0), with lane counts distinct from each other and from
        `rows`, and >= 2, so that none is specialized or tied to another."""
        device = self.executor.device
        lanes, sliding_lanes = 7, 5

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        full_mask = zeros(rows, 1, 1, lanes, dtype=torch.bool)
        full_mask[..., 0] = True
        sliding_mask = zeros(rows, 1, 1, sliding_lanes, dtype=torch.bool)
        sliding_mask[..., 0] = True
        return StepInputs(
            zeros(rows),
            zeros(rows),
            zeros(rows),
            zeros(rows, lanes),
            full_mask,
            zeros(rows, sliding_lanes),
            sliding_mask,
        )

    # -- serving -----------------------------------------------------------------------
    def fits(self, num_tokens: int) -> bool:
        return self.ready and num_tokens <= self.max_tokens

    def pays(self, extend: np.ndarray, seq: np.ndarray) -> bool:
        """The graph's per-row gathers stay within MAX_EXTRA_GATHER_BYTES of eager's."""
        ex = self.executor
        elem = ex.kv_cache.dtype.itemsize
        return extra_gather_bytes(extend, seq, ex.config, elem) <= MAX_EXTRA_GATHER_BYTES

    def inputs(self, meta: AttentionMetadata, input_ids: Tensor) -> StepInputs:
        """The graph's inputs for a built step (`AttentionMetadata`)."""
        extend = meta.extend_lens_host.astype(np.int64)
        request = np.repeat(np.arange(extend.size), extend)
        within = np.arange(int(extend.sum()), dtype=np.int64) - np.repeat(
            meta.qo_indptr_host[:-1].astype(np.int64), extend
        )
        positions = meta.prefix_lens_host.astype(np.int64)[request] + within
        kv_start = meta.kv_indptr_host[:-1].astype(np.int64)[request]
        full, full_valid, sliding, sliding_valid = key_lanes(
            kv_start, positions, meta.shape.sliding_window
        )
        device = meta.kv_indices.device
        index = torch.from_numpy(np.concatenate([full.ravel(), sliding.ravel()])).to(device)
        slots = meta.kv_indices[index]
        valid = torch.from_numpy(np.concatenate([full_valid.ravel(), sliding_valid.ravel()]))
        slots = torch.where(valid.to(device), slots, torch.zeros_like(slots))
        return StepInputs(
            input_ids=input_ids,
            positions=meta.positions,
            out_slots=meta.out_slots,
            full_slots=slots[: full.size].view(full.shape),
            full_mask=torch.from_numpy(full_valid).to(device)[:, None, None, :],
            sliding_slots=slots[full.size :].view(sliding.shape),
            sliding_mask=torch.from_numpy(sliding_valid).to(device)[:, None, None, :],
        )

    def known(self, args: tuple[Tensor, ...]) -> bool:
        """Whether a step's inputs are of the kinds the graphs were compiled and guarded
        for (see the module doc), so Dynamo's guards may be skipped."""
        if self._traced_for is None or ex_state(self.executor) != self._traced_for[0]:
            return False
        if _layouts(args) != self._traced_for[1]:
            return False
        rows, lanes, sliding_lanes = args[0].shape[0], args[3].shape[1], args[5].shape[1]
        return (
            rows >= 1
            and lanes >= 2
            and sliding_lanes >= 2
            and args[1].shape[0] == args[2].shape[0] == rows
            and args[3].shape[0] == args[5].shape[0] == rows
            and tuple(args[4].shape) == (rows, 1, 1, lanes)
            and tuple(args[6].shape) == (rows, 1, 1, sliding_lanes)
        )

    def run(self, inputs: StepInputs) -> Tensor | None:
        """Hidden states [T, hidden], or None where the graph
        would have to recompile (the caller then runs the step eagerly)."""
        args = inputs.as_args()
        skip = self.known(args)
        self.guarded += not skip
        if skip and self._direct is not None:
            wide = args[0].shape[0] > 1
            with torch.inference_mode():
                hidden = self._direct[wide](self, *args)
            self.steps += 1
            self.direct_by_graph[wide] += 1
            return hidden
        try:
            with (
                torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=skip),
                torch.inference_mode(),
            ):
                hidden = self._compiled(*args)
        except RuntimeError as exc:
            if "recompil" not in str(exc).lower():
                raise
            self.fallbacks += 1
            return None
        self.steps += 1
        return hidden


def _dynamo_codes(fn) -> list | None:
    """The code objects Dynamo compiled for `fn`'s code, newest first (None where this
    torch does not say: a private API)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return [entry.code for entry in _debug_get_cache_entry_list(fn.__func__.__code__)]
    except Exception:  # noqa: BLE001 - then known steps keep the guard-skipping call
        return None


def ex_state(executor) -> tuple[int, ...]:
    """The identity of what a compiled step reads besides its inputs: the model and the KV
    pool's tensors (a new pool or model would fail Dynamo's identity guards)."""
    kv = executor.kv_cache
    return (id(executor.model), id(kv), *map(id, kv.tensors()))


def _layouts(args: tuple[Tensor, ...]) -> tuple:
    """Each input's dtype, device, rank and whether it is contiguous: with the lanes and
    rows the only ways `StepInputs` vary."""
    return tuple((a.dtype, a.device, a.dim(), a.is_contiguous()) for a in args)
