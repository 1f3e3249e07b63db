"""Model definitions by architecture; `load_model` (any supported source -> module),
`load_quantized_model` (the same with its linears and LM head quantized while loading),
`load_for` (either, as `model.quantization` asks) and `quantize_model` (a built model's
linears and LM head in int8 / int4, `kernels.quant`).

`load_model(None)` is the embedded Gemma 3 270M GGUF; a `.gguf` file, a folder holding one
GGUF, or a Hugging Face folder (config.json + safetensors) also work. Modules are built on
the meta device and receive the loaded tensors directly (no random init, no copy). When
quantizing, each linear weight is quantized as soon as it is read, so loading never holds
the model in full precision (`build_quantized_model`).

`resolve_quantization` settles `model.quantization = "auto"`: a quantized GGUF the user
gives stays quantized (int4 where stored in 4-bit blocks, int8 elsewhere), as llama.cpp
keeps it; the embedded model, float GGUFs and HF folders run exact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from kernels.config import ModelConfig
from kernels.lm_head import LmHead
from kernels.models.gemma3 import Gemma3ForCausalLM
from kernels.models.llama import LlamaForCausalLM
from kernels.quant import QuantizedPart, QuantizedWeight, quantize_linears
from kernels.quant_layout import AS_STORED

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "gemma3": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype) -> nn.Module:
    """Instantiate the module for `config.arch` and bind `weights` (checkpoint names, cast
    to `dtype`; q/k/v and gate/up are stacked on the way)."""
    from kernels.linear import stack_projections

    with torch.device("meta"):
        model = MODEL_CLASSES[config.arch](config)
    state = {name: t if t.dtype == dtype else t.to(dtype) for name, t in weights.items()}
    state = stack_projections(state)
    expected = set(model.state_dict())
    return bind_weights(model, config, state, expected - set(state), set(state) - expected)


def bind_weights(model: nn.Module, config: ModelConfig, state, missing, unexpected) -> nn.Module:
    """`model` (on the meta device) with `state` assigned, in eval mode without grads; a
    ValueError naming what does not fit when anything is `missing` or `unexpected`."""
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit {config.arch}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.requires_grad_(False)
    return model.eval()


def resolve_model_source(path: str | Path | None) -> tuple[str, Path]:
    """("gguf", file) or ("hf", folder) for a model path; None is the embedded GGUF."""
    from kernels.gguf_loader import default_model_path
    from kernels.hf_loader import is_hf_folder

    if path is None:
        return "gguf", default_model_path()
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if is_hf_folder(path):
        return "hf", path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a HF model folder")


def load_config(path: str | Path | None) -> ModelConfig:
    from kernels.gguf_loader import load_gguf_config
    from kernels.hf_loader import read_hf_config

    kind, source = resolve_model_source(path)
    return load_gguf_config(source) if kind == "gguf" else read_hf_config(source)


def load_model(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, nn.Module]:
    """(config, model) for a GGUF file, a HF folder, or None for the embedded Gemma 3 270M."""
    config = load_config(path)
    model = build_model(config, load_model_weights(path, dtype, config), dtype)
    kind, source = resolve_model_source(path)
    if kind == "gguf":
        model.gguf_path = str(source)  # its head's and linears' own blocks (kernels/gguf_blocks)
    return config, model


def load_model_weights(
    path: str | Path | None, dtype: torch.dtype, config: ModelConfig | None = None
) -> dict[str, Tensor]:
    """The checkpoint's tensors by (HF) name, minus the leading "model.", in `dtype`."""
    from kernels.gguf_loader import load_gguf_weights
    from kernels.hf_loader import load_hf_weights

    kind, source = resolve_model_source(path)
    if kind == "gguf":
        return load_gguf_weights(source, dtype)
    return load_hf_weights(source, config or load_config(path), dtype)


def load_quantized_model(
    path: str | Path | None, dtype: torch.dtype, activations: dict[str, torch.dtype]
) -> tuple[ModelConfig, nn.Module, LmHead]:
    """(config, model, LM head) with the decoder linears and the LM head quantized while
    loading, tensor by tensor. `activations` maps each kind the plan may use to the dtype
    its products run in: one kind quantizes everything to it; int4 and int8 together (a
    quantized GGUF kept as stored, `resolve_quantization`) keep weights stored in 4-bit
    blocks int4, read straight from the blocks, and make every other weight int8. The rest
    of the model (embedding table, norms) is `dtype`."""
    from kernels.gguf_loader import gguf_weight_stream, load_gguf_config
    from kernels.hf_loader import iter_hf_weights, read_hf_config

    kind, source = resolve_model_source(path)
    config = load_gguf_config(source) if kind == "gguf" else read_hf_config(source)
    if kind == "gguf":
        tensors = gguf_weight_stream(source, config, dtype, activations)
    else:
        tensors = iter_hf_weights(source, config, torch.float32)
    # a tied head is the embedding table: its int4 part, when it arrived as one
    model, head_part = build_quantized_model(config, tensors, dtype, activations)
    if head_part is None:  # the head is quantized from its float weight
        head_kind = "int8" if "int8" in activations else "int4"
        quantized = None
    else:
        head_kind = head_part.kind
        quantized = QuantizedWeight.from_parts(head_kind, [(head_part.q, head_part.scales)])
    lm_head = LmHead(
        model.lm_head_weight,
        config.final_logit_softcap,
        backend=head_kind,
        quantized_activations=activations[head_kind],
        quantized=quantized,
    )
    if not config.tie_embeddings:  # the quantized head is the only one used: the float goes
        model.lm_head.weight = nn.Parameter(lm_head.release_exact_weight(), requires_grad=False)
    return config, model, lm_head


def build_quantized_model(
    config: ModelConfig,
    tensors,  # iterable of (checkpoint name, float tensor or QuantizedPart), one at a time
    dtype: torch.dtype,
    activations: dict[str, torch.dtype],
) -> tuple[nn.Module, QuantizedPart | None]:
    """`build_model` for a quantized model (`load_quantized_model`'s plan), and the LM
    head's `QuantizedPart` when it arrived quantized (its parameter is then a one-element
    stand-in), or the tied embedding's when that arrived in int4 (it becomes an
    `Int4Embedding`). Each decoder linear weight is quantized when it arrives (`quantize_part`; a
    `QuantizedPart` as it is) and its float tensor dropped, so peak memory is the quantized
    model plus one float tensor. Stacked projections join their parts' rows: int4 when
    every part is, else int8 (int4 parts re-quantized to int8 per output row: not lossless,
    since int8 has one scale a row where the int4 blocks had one per 32 weights)."""
    from kernels.linear import STACKED_PROJECTIONS, decoder_linear, stack_projections
    from kernels.quant import Int4Embedding, QuantizedLinear, quantize_part

    with torch.device("meta"):
        model = MODEL_CLASSES[config.arch](config)
    # checkpoint linear -> (the model's fused linear, all the checkpoint linears it stacks)
    fused_of: dict[str, tuple[str, list[str]]] = {}
    for fused_name, fused in model.named_modules():
        if isinstance(fused, nn.Linear) and fused_name.startswith("layers."):
            parent, _, leaf = fused_name.rpartition(".")
            names = [f"{parent}.{p}" for p in STACKED_PROJECTIONS.get(leaf, (leaf,))]
            fused_of.update({n: (fused_name, names) for n in names})
    float_kind = "int8" if "int8" in activations else next(iter(activations))
    head_part = None
    parts: dict[str, QuantizedPart] = {}
    joined: dict[str, object] = {}  # fused linear -> its QuantizedWeight, once complete
    state: dict[str, Tensor] = {}
    for name, tensor in tensors:
        module = decoder_linear(name)
        if name == "lm_head.weight" and isinstance(tensor, QuantizedPart):
            head_part = tensor
            state[name] = torch.zeros((), dtype=dtype).expand(config.vocab, config.hidden)
            continue
        if name == "embed_tokens.weight" and isinstance(tensor, QuantizedPart):
            model.embed_tokens = Int4Embedding(tensor.q, tensor.scales, dtype)
            if config.tie_embeddings:
                head_part = tensor
            continue
        if module is None:
            if isinstance(tensor, QuantizedPart):
                raise ValueError(f"{name} arrived quantized as {tensor.kind}")
            state[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
            continue
        if module not in fused_of:
            raise ValueError(f"weights do not fit {config.arch}: unexpected {name}")
        if isinstance(tensor, QuantizedPart):
            if tensor.kind not in activations:
                raise ValueError(f"{name} arrived quantized as {tensor.kind}")
            parts[module] = tensor
        else:
            q, scales = quantize_part(tensor, float_kind, activations[float_kind])
            parts[module] = QuantizedPart(float_kind, q, scales)
        del tensor
        # Join a fused linear as soon as its last part arrives: the unpacked parts never
        # pile up (the whole model's would be twice its packed size).
        fused_name, names = fused_of[module]
        if all(n in parts for n in names):
            joined[fused_name] = _joined([parts.pop(n) for n in names], activations)
    state = stack_projections(state)
    for fused_name, fused in list(model.named_modules()):
        if not isinstance(fused, nn.Linear) or not fused_name.startswith("layers."):
            continue
        if fused_name not in joined:
            missing = next(n for n in fused_of if fused_of[n][0] == fused_name and n not in parts)
            raise ValueError(f"weights do not fit {config.arch}: missing {missing}.weight")
        bias = state.pop(f"{fused_name}.bias", None)
        if (bias is None) != (fused.bias is None):
            raise ValueError(f"weights do not fit {config.arch}: {fused_name}'s bias")
        parent, _, leaf = fused_name.rpartition(".")
        model.get_submodule(parent).add_module(
            leaf, QuantizedLinear(quantized=joined.pop(fused_name), bias=bias)
        )
    own = model.state_dict()
    missing = {n for n, t in own.items() if t.is_meta} - set(state)
    unexpected = (set(state) - set(own)) | {f"{n}.weight" for n in parts}
    return bind_weights(model, config, state, missing, unexpected), head_part


def _joined(parts, activations: dict[str, torch.dtype]):
    """One `QuantizedWeight` of stacked parts: int4 when all are, else all as int8."""
    from kernels.quant import QuantizedWeight, dequantize_groups, quantize_part

    if all(p.kind == "int4" for p in parts):
        return QuantizedWeight.from_parts("int4", [(p.q, p.scales) for p in parts])
    widened = [
        (p.q, p.scales)
        if p.kind == "int8"
        else quantize_part(dequantize_groups(p.q, p.scales), "int8", activations["int8"])
        for p in parts
    ]
    return QuantizedWeight.from_parts("int8", widened)


def quantized_lm_head(model: nn.Module, config: ModelConfig, kind: str, activations) -> LmHead:
    """The LM head of a built model quantized to `kind` (over the tied embedding, which
    keeps its full-precision table for the lookup)."""
    return LmHead(
        model.lm_head_weight,
        config.final_logit_softcap,
        backend=kind,
        quantized_activations=activations,
    )


PLAN_KINDS: dict[str, tuple[str, ...]] = {
    "none": (),
    "int8": ("int8",),
    "int4": ("int4",),
    AS_STORED: ("int4", "int8"),
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def resolve_quantization(
    requested: str, path: str | Path | None, config: ModelConfig, device: str = "cpu"
) -> tuple[str, str]:
    """(none | int8 | int4 | gguf, why) for `model.quantization = requested` on this model.

    auto keeps a quantized GGUF the user gives quantized, tensor by tensor, as close to how
    it is stored as our kernels allow ("gguf"): 4-bit blocks (Q4_0, Q4_1, Q4_K) become int4
    losslessly; every other type int8 per output channel, the finer of the two layouts the
    kernels have (not lossless either: one scale a row where the file had one per block;
    its cost is measured in docs/benchmarks.md). The embedded model, float GGUFs and HF
    folders run exact."""
    if requested == AS_STORED and config.extra.get("source") != "gguf":
        raise ValueError(f'quantization = "{AS_STORED}" keeps a GGUF\'s own; this is no GGUF')
    if requested != "auto":
        return requested, "set in the config"
    if device != "cpu":
        return "none", f"auto: quantized weights are a CPU path, not {device}"
    if path is None or config.extra.get("source") != "gguf":
        what = "the embedded model" if path is None else "a Hugging Face folder"
        return "none", f"auto: {what} runs exact"
    types = config.extra.get("weight_types") or {}
    dominant = max(types, key=types.__getitem__, default="F32")
    if dominant in _FLOAT_TYPES:
        return "none", f"auto: the GGUF's weights are {dominant}: exact"
    stored = ", ".join(f"{t} {n / 1e6:.0f}M" for t, n in sorted(types.items()))
    return AS_STORED, (
        f"auto: a quantized GGUF ({stored} weights) stays quantized: int4 where stored in "
        f'4-bit blocks, int8 elsewhere; model.quantization = "none" runs it exact'
    )


def load_for(
    path: str | Path | None,
    dtype: torch.dtype,
    quantization: str = "none",
    device: str = "cpu",
    require_faster: bool | None = None,
) -> tuple[ModelConfig, nn.Module, LmHead | None, str, str]:
    """(config, model, quantized LM head or None, resolved mode, why) for
    `model.quantization = quantization`, as the runner loads it: "auto" resolved
    (`resolve_quantization`), each kind's products in the activation dtype timed fastest
    here. With `require_faster` (default: for a mode asked for by name) the quantized
    product must beat the exact one on this CPU, else ValueError with the timings; auto
    keeps a quantized GGUF quantized for its size."""
    from kernels.quant import activations_for

    config = load_config(path)
    mode, why = resolve_quantization(quantization, path, config, device)
    if require_faster is None:
        require_faster = quantization != "auto"
    activations: dict[str, torch.dtype] = {}
    for kind in PLAN_KINDS[mode]:
        chosen, timings = activations_for(kind, config, dtype, require_faster)
        if chosen is None:
            raise ValueError(timings)
        activations[kind] = chosen
        why = f"{why}; {timings}"
    if not activations:
        return (*load_model(path, dtype), None, mode, why)
    return (*load_quantized_model(path, dtype, activations), mode, why)


def quantize_model(
    model: nn.Module, config: ModelConfig, activations: torch.dtype, kind: str = "int8"
) -> LmHead:
    """Quantize `model`'s decoder linears in place to `kind`; returns its quantized LM head
    (the executor's `lm_head`, over the tied embedding that keeps its full-precision table)."""
    quantize_linears(model.layers, kind, activations)
    return quantized_lm_head(model, config, kind, activations)


__all__ = [
    "MODEL_CLASSES",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "bind_weights",
    "build_model",
    "build_quantized_model",
    "load_for",
    "load_quantized_model",
    "load_config",
    "load_model",
    "load_model_weights",
    "quantize_model",
    "quantized_lm_head",
    "resolve_model_source",
    "resolve_quantization",
]
