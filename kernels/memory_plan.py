"""The memory plan: what the weights and the KV pool take, and how many KV pages fit.

At start (`actors.app.specs.memory_plan`) the engine estimates the bytes of the model's
weights in the mode it will run (dtype, quantization, linear layout), the bytes of a KV page,
and the memory available on the device, then decides the KV pool's size:

* `kv.num_pages` as configured (`kv.memory_fraction = 0` and `kv.memory_bytes = 0`, the
  default);
* `kv.memory_fraction = f`: weights plus the KV pool take at most f of the memory available
  at start (vLLM's `gpu_memory_utilization`, of what is free rather than of the total);
* `kv.memory_bytes = B`: the KV pool takes at most B bytes (llama.cpp's `-c` as bytes).

With a budget, the sliding layers' own pool (`kv.swa_num_pages`) keeps its proportion to the
full pool: as many pages for -1, N / kv.num_pages of them for an explicit N.

Both pools are committed in full when the runner allocates them (`torch.zeros` writes every
page, on the CPU as on CUDA), so a plan whose weights plus pool exceed the memory available
is refused at start, whichever way the pool was sized; so is a weight set that alone exceeds
it, and a budget whose pool cannot hold one request of `kv.context_len` tokens. Each refusal
(`MemoryPlanError`) names the figures and what to change.

The weight figure is an estimate of what our modules hold once loaded, not the loading
peak: the input embedding (always the model dtype), each layer's fused q/k/v and o, gate/up
and down projections (plus biases where `attention_bias`), its norms (and q/k norms), the
final norm, an untied LM head, and the LM head's extra copies: oneDNN's packed copy on the
CPU, the fp16 copy with `model.linear = "fp16"`, the quantized copy when quantized.
`measured_weight_bytes` counts a loaded model's tensors for comparison.

Pure Python: torch is imported only inside `available_memory` (CUDA) and
`measured_weight_bytes`, so the unit tier imports this module without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kernels.config import ModelConfig
from kernels.quant_layout import AS_STORED, INT4_BLOCK_TYPES, INT4_GROUP, INT4_ROWS

GIB = 1 << 30
# a weight held as packed int8 blocks (kernels.gguf_blocks), at most: int8, two fp32 scales
# and a minimum per 32 (a stacked projection mixing Q6_K's and Q4_K's kinds); Q8_0's 1.0625
Q8_0_BYTES = 1 + 8 / 32 + 4 / 32
Q8_0_WIDENED = ("Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q6_K")  # GGUF types read as such blocks
LOW_HEADROOM_SHARE = 0.05  # a plan leaving less than this share of memory free is warned of
_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
}


class MemoryPlanError(ValueError):
    """The model or its KV pool cannot fit the memory available: refused at start."""


def bytes_per_element(dtype: Any) -> int:
    """Bytes of one element of `dtype`: a name ("bfloat16", "fp32") or a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"no byte size known for dtype {dtype!r}")
    return _DTYPE_BYTES[name]


def gib(n: int | float) -> str:
    """`n` bytes as "1.23 GiB"."""
    return f"{n / GIB:.2f} GiB"


# --- weights ---------------------------------------------------------------------------------


def linear_bytes(
    out_features: int,
    in_features: int,
    dtype_bytes: int,
    quantization: str = "none",
    activation_bytes: int | None = None,
) -> int:
    """One [out, in] linear weight (no bias) as stored: `dtype_bytes` a weight exact; int8: one
    byte a weight plus a scale per output row; int4: half a byte a weight plus a (scale, zero)
    pair per 32 input channels of each output row, rows padded to a multiple of 16. Scales
    are in the activation dtype (`activation_bytes`, default `dtype_bytes`)."""
    scale = activation_bytes or dtype_bytes
    if quantization == "none":
        return out_features * in_features * dtype_bytes
    if quantization == "int8":
        return out_features * in_features + out_features * scale
    if quantization == "int4":
        rows = -(-out_features // INT4_ROWS) * INT4_ROWS
        return rows * in_features // 2 + (in_features // INT4_GROUP) * rows * 2 * scale
    raise ValueError(f"quantization must be none, int8 or int4, got {quantization!r}")


@dataclass(frozen=True)
class WeightBytes:
    """Estimated bytes of a loaded model, by part."""

    embedding: int  # the input embedding table (model dtype, even when quantized)
    decoder: int  # every layer's linears, biases and norms, and the final norm
    lm_head: int  # an untied head's weight and the head's extra copies (oneDNN, fp16, quantized)

    @property
    def total(self) -> int:
        return self.embedding + self.decoder + self.lm_head


def weight_bytes(
    config: ModelConfig,
    dtype_bytes: int,
    quantization: str = "none",
    *,
    activation_bytes: int | None = None,
    linear: str = "aten",
    lm_head_onednn: bool = False,
) -> WeightBytes:
    """What our modules hold for `config` with weights in `dtype_bytes` and `quantization`
    (none / int8 / int4). `linear`: the decoder linears' layout when exact ("fp16": fp16
    copies of fp32 weights, plus Q8_0 blocks of those a GGUF stores so, `widened_share`;
    "onednn+fp16": the model dtype's and an fp16 copy, or fewer bytes of blocks in its
    place; "aten" / "onednn": the model dtype). `lm_head_onednn`: the exact LM head keeps a
    oneDNN-packed copy of its weight (the CPU's `LmHead`; with "fp16" linears, of the
    fp16-rounded values in fp32, or of the exact ones where the head reads Q8_0 blocks in
    place of its fp16 copy: the same bytes). The head's blocks are counted as that fp16 copy
    (2 bytes a weight against their 1.0625): an upper bound."""
    if quantization == AS_STORED:
        return _as_stored_bytes(config, dtype_bytes, activation_bytes)
    c, d = config, dtype_bytes
    quantized = quantization != "none"
    stored = d  # bytes a decoder weight is held in
    if not quantized and linear == "fp16":
        # fp16-packed, plus Q8_0 blocks of the linears a GGUF stores so (kernels.gguf_blocks)
        stored = 2 + Q8_0_BYTES * widened_share(c)
    elif not quantized and linear == "onednn+fp16":
        stored = d + 2  # the model dtype's packed copy and an fp16 one (or fewer: Q8_0 blocks)

    def lin(out_features: int, in_features: int) -> int:
        if quantized:
            return linear_bytes(out_features, in_features, d, quantization, activation_bytes)
        return round(out_features * in_features * stored)

    qkv_out = c.q_size + 2 * c.kv_size
    layer = (
        lin(qkv_out, c.hidden)
        + lin(c.hidden, c.q_size)
        + lin(2 * c.intermediate, c.hidden)
        + lin(c.hidden, c.intermediate)
    )
    # biases (kept in the dtype, fp32 for fp16 linears): Qwen2 biases q/k/v only
    bias_bytes = 4 if linear == "fp16" and not quantized else d
    if c.attention_bias:
        layer += qkv_out * bias_bytes
        if c.arch != "qwen2":
            layer += c.hidden * bias_bytes
    norms = (4 if c.is_gemma else 2) * c.hidden
    if c.is_gemma or c.qk_norm:
        norms += 2 * c.head_dim
    layer += norms * d
    decoder = c.num_layers * layer + c.hidden * d  # + the final norm
    table = c.vocab * c.hidden
    embedding = table * d
    # an untied head's float weight is released once its quantized copy is made
    head = 0 if c.tie_embeddings or quantized else table * d
    if quantized:
        head += linear_bytes(c.vocab, c.hidden, d, quantization, activation_bytes)
    elif linear == "fp16":
        head += table * 2 + (table * 4 if lm_head_onednn else 0)
    elif linear == "onednn+fp16":
        head += table * 2 + (table * d if lm_head_onednn else 0)
    elif lm_head_onednn:
        head += table * d
    return WeightBytes(embedding=embedding, decoder=decoder, lm_head=head)


def widened_share(config: ModelConfig) -> float:
    """Share of a GGUF's decoder linears stored in types `kernels.gguf_blocks` reads as int8
    blocks (`Q8_0_WIDENED`), an upper bound of the share that gets such blocks."""
    types = config.extra.get("linear_types") or {}
    total = sum(types.values())
    return sum(n for t, n in types.items() if t in Q8_0_WIDENED) / total if total else 0.0


def int4_share(config: ModelConfig) -> float:
    """Share of a GGUF's decoder linears stored in 4-bit blocks (kept int4 as stored); an
    estimate: a stacked projection with one part in another type is int8 whole."""
    types = config.extra.get("linear_types") or config.extra.get("weight_types") or {}
    total = sum(types.values())
    return sum(n for t, n in types.items() if t in INT4_BLOCK_TYPES) / total if total else 0.0


def _as_stored_bytes(config: ModelConfig, d: int, activation_bytes: int | None) -> WeightBytes:
    """A quantized GGUF kept as stored: decoder linears int4 in the share stored in 4-bit
    blocks, int8 elsewhere; the embedding table int4 rows when stored in 4-bit blocks, else
    the model dtype; the head int4 when stored so, else int8 (no float copy)."""
    c = config
    share = int4_share(c)
    int4, int8 = (
        weight_bytes(c, d, kind, activation_bytes=activation_bytes) for kind in ("int4", "int8")
    )
    decoder = round(share * int4.decoder + (1 - share) * int8.decoder)
    scale = activation_bytes or d
    four_bit = {
        role: c.extra.get(f"{role}_type") in INT4_BLOCK_TYPES for role in ("embedding", "head")
    }
    table = c.vocab * c.hidden
    embedding = (
        table // 2 + (c.hidden // INT4_GROUP) * c.vocab * 2 * scale
        if four_bit["embedding"]
        else table * d
    )
    head = linear_bytes(c.vocab, c.hidden, d, "int4" if four_bit["head"] else "int8", scale)
    return WeightBytes(embedding=embedding, decoder=decoder, lm_head=head)


def measured_weight_bytes(model: Any, lm_head: Any = None) -> int:
    """Bytes a loaded model holds: its parameters and buffers (storages shared by several
    tensors, as a tied embedding and head, counted once), its packed and quantized linears
    (`OneDnnLinear`, `Fp16Linear`, `QuantizedLinear`, the blocks of `Q8_0NarrowLinear`), and
    `lm_head`'s (an `LmHead`, e.g. the
    executor's) weight and copies. For the runner to report beside the estimate."""
    import torch

    seen: set[Any] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        try:
            storage = t.untyped_storage()
            key, size = (str(t.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # opaque (oneDNN) tensors
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None and hasattr(module, "weight_bytes"):  # OneDnnLinear, Fp16Linear
            if isinstance(packed, torch.Tensor):
                add(packed)
            else:  # fbgemm's opaque object
                total += int(module.weight_bytes)
            add(getattr(module, "bias", None))
        for holder in (getattr(module, "quantized", None), getattr(module, "blocks", None)):
            for t in getattr(holder, "tensors", ()):  # QuantizedLinear, Q8_0NarrowLinear
                add(t)
    if lm_head is not None:
        add(getattr(lm_head, "weight", None))
        add(getattr(lm_head, "_packed", None))
        if getattr(lm_head, "_fp16", None) is not None:
            total += int(lm_head.weight.numel()) * 2
        for t in getattr(getattr(lm_head, "_quantized", None), "tensors", ()):
            add(t)
        for t in getattr(getattr(lm_head, "_q8_0", None), "tensors", ()):
            add(t)
    return total


# --- KV --------------------------------------------------------------------------------------


def kv_token_bytes(config: ModelConfig, dtype_bytes: int, split: bool) -> tuple[int, int]:
    """(bytes of K and V of one token in the full pool, in the sliding pool). Split (a
    sliding pool of their own), the sliding layers' KV is in the second pool; else every
    layer's is in the first and the second is 0 (as `kernels.kv_cache.KVCache`)."""
    per_layer = 2 * config.num_kv_heads * config.head_dim * dtype_bytes  # K and V
    sliding = len(config.sliding_layers) if split else 0
    return (config.num_layers - sliding) * per_layer, sliding * per_layer


def kv_pool_bytes(
    config: ModelConfig, dtype_bytes: int, page_size: int, num_pages: int, swa_num_pages: int = 0
) -> int:
    """Bytes `KVCache` allocates: `num_pages` + 1 (the padding page) pages of every full layer,
    and, when `swa_num_pages` > 0 and the model has sliding layers, `swa_num_pages` + 1 of
    every sliding layer."""
    split = swa_num_pages > 0 and bool(config.sliding_layers)
    full, sliding = kv_token_bytes(config, dtype_bytes, split)
    return page_size * ((num_pages + 1) * full + ((swa_num_pages + 1) * sliding if split else 0))


# --- memory available --------------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's memory cgroup still allows (its limit less its usage), or None
    when it sets no limit (v2 `memory.max`, v1 `memory.limit_in_bytes`)."""
    for limit_name, usage_name in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(root / limit_name)
        if limit is not None and limit < 1 << 60:  # v1 writes "no limit" as a huge number
            usage = _read_int(root / usage_name) or 0
            return max(limit - usage, 0)
    return None


def _mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes available to this process now on `device`, where the figure comes from).
    CPU: /proc/meminfo's MemAvailable, or less when the memory cgroup allows less; CUDA:
    `torch.cuda.mem_get_info`'s free bytes of the current device."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        free, total = torch.cuda.mem_get_info(index if index is not None else None)
        return int(free), f"free on the GPU ({gib(free)} of {gib(total)})"
    available = _mem_available()
    where = "MemAvailable in /proc/meminfo"
    if available is None:
        import psutil

        available, where = int(psutil.virtual_memory().available), "psutil's available memory"
    room = _cgroup_room()
    if room is not None and room < available:
        available, where = room, "the memory cgroup's limit less its usage"
    return available, where


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """The KV pool's size and the figures it was decided from (bytes)."""

    num_pages: int  # full pool, without the padding page
    swa_num_pages: int  # the sliding layers' own pool (0: none)
    page_size: int
    weights: int  # estimated
    kv_pool: int  # both pools as allocated (padding pages included)
    available: int  # on the device, at start
    why: str  # how num_pages was chosen
    device: str = "cpu"
    warnings: tuple[str, ...] = field(default=())

    @property
    def headroom(self) -> int:
        """What is left for activations, the rest of the process and everything else."""
        return self.available - self.weights - self.kv_pool

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    def log_fields(self) -> dict[str, Any]:
        return dict(
            device=self.device,
            weights=gib(self.weights),
            kv_pool=gib(self.kv_pool),
            available=gib(self.available),
            headroom=gib(self.headroom),
            num_pages=self.num_pages,
            swa_num_pages=self.swa_num_pages,
            kv_tokens=self.kv_tokens,
            why=self.why,
        )


def budget_pages(budget: int, full_page: int, swa_page: int, swa_ratio: float) -> int:
    """The most full pages n whose pool, (n + 1) full pages plus (pages(n) + 1) sliding ones
    (pages(n) = n for a ratio of 1, else floor(ratio * n), at least 1), fits `budget`; 0 when
    not even one does."""

    def swa_for(n: int) -> int:
        if not swa_page:
            return 0
        return n if swa_ratio == 1.0 else max(int(swa_ratio * n), 1)

    def pool(n: int) -> int:
        return (n + 1) * full_page + ((swa_for(n) + 1) * swa_page if swa_page else 0)

    spare = budget - full_page - (swa_page if swa_page else 0)
    if spare <= 0:
        return 0
    n = int(spare // (full_page + swa_ratio * swa_page))
    while n > 0 and pool(n) > budget:
        n -= 1
    return n


def plan_memory(
    config: ModelConfig,
    *,
    dtype: str,
    quantization: str,
    available: int,
    page_size: int,
    num_pages: int,
    swa_num_pages: int,
    context_len: int,
    memory_fraction: float = 0.0,
    memory_bytes: int = 0,
    chunk_size: int = 0,
    device: str = "cpu",
    linear: str = "aten",
    activation_bytes: int | None = None,
    weights: int | None = None,
    available_why: str = "",
) -> MemoryPlan:
    """Decide the KV pool for `config` with weights and KV in `dtype` (see the module's doc);
    raises `MemoryPlanError`.

    `swa_num_pages` as configured: -1 as many as num_pages, 0 no sliding pool, N pages.
    `weights`: measured bytes, else estimated with `weight_bytes` (the oneDNN copy of the LM
    head counted on the CPU). `chunk_size`: the prefill chunk; a budgeted sliding pool must
    hold at least a window plus one chunk."""
    size = bytes_per_element(dtype)
    on_cpu = device == "cpu"
    where = "on the CPU" if on_cpu else f"on {device}"
    source_of = available_why or "at start"
    mode = dtype.removeprefix("torch.") + ("" if quantization == "none" else f", {quantization}")

    def estimate(kind: str) -> int:
        return weight_bytes(
            config,
            size,
            kind,
            activation_bytes=activation_bytes,
            linear=linear,
            lm_head_onednn=on_cpu,
        ).total

    if weights is None:
        weights = estimate(quantization)
    if weights > available:
        smaller = {"none": ("int8", "int4"), "int8": ("int4",), AS_STORED: ("int4",)}.get(
            quantization, ()
        )
        fits = [k for k in smaller if estimate(k) < available]
        fix = (
            f"--quantization {fits[0]} (model.quantization = {fits[0]}: ~{gib(estimate(fits[0]))})"
            if fits
            else "a smaller model"
        )
        raise MemoryPlanError(
            f"the weights alone (~{gib(weights)}, {mode}) exceed the {gib(available)} "
            f"available {where} ({source_of}): use {fix}, or free memory"
        )
    split = swa_num_pages != 0 and bool(config.sliding_layers)
    full_token, swa_token = kv_token_bytes(config, size, split)
    full_page, swa_page = page_size * full_token, page_size * swa_token
    if not split:
        swa_ratio = 0.0
    elif swa_num_pages == -1:
        swa_ratio = 1.0
    else:
        swa_ratio = swa_num_pages / num_pages

    def swa_for(pages: int) -> int:
        if not split:
            return 0
        return pages if swa_ratio == 1.0 else max(int(swa_ratio * pages), 1)

    if memory_fraction or memory_bytes:
        if memory_bytes:
            budget = memory_bytes
            source = f"kv.memory_bytes = {memory_bytes} ({gib(memory_bytes)}) for the KV pool"
        else:
            budget = int(memory_fraction * available) - weights
            source = (
                f"kv.memory_fraction = {memory_fraction:g} of {gib(available)} available "
                f"{where} is {gib(memory_fraction * available)}, less ~{gib(weights)} of "
                f"weights: {gib(max(budget, 0))} for the KV pool"
            )
        pages = budget_pages(budget, full_page, swa_page, swa_ratio)
        swa_pages = swa_for(pages)
        request_pages = -(-context_len // page_size)
        if pages < request_pages:
            need = kv_pool_bytes(config, size, page_size, request_pages, swa_for(request_pages))
            raise MemoryPlanError(
                f"{source}: {pages} pages of {page_size} tokens, fewer than one request of "
                f"kv.context_len = {context_len} tokens needs ({request_pages} pages, "
                f"~{gib(need)} of KV): raise "
                + ("kv.memory_bytes" if memory_bytes else "kv.memory_fraction")
                + ", lower kv.context_len (--max-model-len)"
                + ("" if quantization == "int4" else ", or quantize (--quantization int4)")
            )
        if split and chunk_size and config.sliding_window:
            window_pages = -(-min(context_len, config.sliding_window + chunk_size) // page_size)
            if swa_pages < window_pages:
                raise MemoryPlanError(
                    f"{source}: the sliding layers' pool gets {swa_pages} pages "
                    f"(kv.swa_num_pages = {swa_num_pages} of kv.num_pages = {num_pages}), "
                    f"fewer than one request's window ({config.sliding_window} tokens) and a "
                    f"prefill chunk ({chunk_size}) need ({window_pages} pages): raise "
                    "kv.swa_num_pages (-1: as many as the full pool)"
                )
        why = f"{source}: {pages} pages"
    else:
        pages, swa_pages = (
            num_pages,
            ((num_pages if swa_num_pages == -1 else swa_num_pages) if split else 0),
        )
        why = f"kv.num_pages = {num_pages} as configured"
    kv = kv_pool_bytes(config, size, page_size, pages, swa_pages)
    plan = MemoryPlan(
        num_pages=pages,
        swa_num_pages=swa_pages,
        page_size=page_size,
        weights=weights,
        kv_pool=kv,
        available=available,
        why=why,
        device=device,
    )
    if plan.headroom < 0:
        # The pool is committed when it is allocated: it must fit now, not as it fills.
        raise MemoryPlanError(
            f"weights (~{gib(weights)}, {mode}) and a KV pool of {pages} pages ({gib(kv)}; "
            f"{why}) need {gib(weights + kv)}, more than the {gib(available)} available "
            f"{where} ({source_of}): size the pool from memory (kv.memory_fraction, e.g. 0.9, "
            "or kv.memory_bytes), lower kv.num_pages, or quantize (--quantization int4)"
        )
    if plan.headroom < LOW_HEADROOM_SHARE * available:
        warning = (
            f"only {gib(plan.headroom)} of the {gib(available)} available {where} is left "
            "beside the weights and the KV pool: activations and the rest of the process "
            "may not fit"
        )
        plan = replace(plan, warnings=(warning,))
    return plan


__all__ = [
    "GIB",
    "MemoryPlan",
    "MemoryPlanError",
    "WeightBytes",
    "available_memory",
    "budget_pages",
    "bytes_per_element",
    "gib",
    "kv_pool_bytes",
    "kv_token_bytes",
    "linear_bytes",
    "measured_weight_bytes",
    "plan_memory",
    "weight_bytes",
]
