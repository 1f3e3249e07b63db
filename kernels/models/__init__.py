"""Model definitions by architecture, `load_model` (any supported source -> module) and
`quantize_model` (its linears and LM head in int8 / int4, `kernels.quant`).

`load_model(None)` is the embedded Gemma 3 270M GGUF; a `.gguf` file, a folder holding one
GGUF, or a Hugging Face folder (config.json + safetensors) also work. Modules are built on
the meta device and receive the loaded tensors directly (no random init, no copy).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from kernels.config import ModelConfig
from kernels.lm_head import LmHead
from kernels.models.gemma3 import Gemma3ForCausalLM
from kernels.models.llama import LlamaForCausalLM
from kernels.quant import quantize_linears

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
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit {config.arch}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
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
    from kernels.gguf_loader import load_gguf_config, load_gguf_weights
    from kernels.hf_loader import load_hf_weights, read_hf_config

    kind, source = resolve_model_source(path)
    if kind == "gguf":
        config = load_gguf_config(source)
        weights = load_gguf_weights(source, dtype)
    else:
        config = read_hf_config(source)
        weights = load_hf_weights(source, config, dtype)
    return config, build_model(config, weights, dtype)


def quantize_model(
    model: nn.Module, config: ModelConfig, activations: torch.dtype, kind: str = "int8"
) -> LmHead:
    """Quantize `model`'s decoder linears in place to `kind`; returns its quantized LM head
    (the executor's `lm_head`, over the tied embedding that keeps its full-precision table)."""
    quantize_linears(model.layers, kind, activations)
    return LmHead(
        model.lm_head_weight,
        config.final_logit_softcap,
        backend=kind,
        quantized_activations=activations,
    )


__all__ = [
    "MODEL_CLASSES",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "build_model",
    "load_config",
    "load_model",
    "quantize_model",
    "resolve_model_source",
]
