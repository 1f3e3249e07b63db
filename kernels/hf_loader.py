"""Hugging Face model folders (config.json + *.safetensors) -> ModelConfig + weights.

Supports Llama, Qwen2, Qwen3 and Gemma 3 (text). The config is parsed with transformers'
own config classes so every default (head_dim, rope parameters per layer type, Gemma's
query_pre_attn_scalar...) is exactly what transformers would use; weights keep HF's names
minus the "model." prefix, which is the naming our model modules use.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from kernels.config import ModelConfig, RopeSpec, UnsupportedModelError

_ARCH_BY_MODEL_TYPE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
# Prefixes under which the text decoder's weights may live (multimodal Gemma 3 nests them).
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_DECODER_PARTS = ("embed_tokens.", "layers.", "norm.", "lm_head.")


def is_hf_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def _hf_text_config(folder: Path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    if getattr(cfg, "model_type", None) == "gemma3" and hasattr(cfg, "text_config"):
        cfg = cfg.text_config
    return cfg


def _rope_specs(cfg, arch: str) -> tuple[RopeSpec, RopeSpec]:
    params = getattr(cfg, "rope_parameters", None) or {}
    default_theta = float(getattr(cfg, "rope_theta", 10_000.0) or 10_000.0)
    if "full_attention" in params or "sliding_attention" in params:
        full = RopeSpec.from_hf(params.get("full_attention"), default_theta)
        local = RopeSpec.from_hf(
            params.get("sliding_attention") or params.get("full_attention"), default_theta
        )
        return full, local
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    spec = RopeSpec.from_hf(params, default_theta)
    return spec, spec


def _eos_ids(folder: Path, cfg) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [getattr(cfg, "eos_token_id", None)]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def read_hf_config(folder: str | Path) -> ModelConfig:
    """ModelConfig for a HF folder, using transformers' config parsing and defaults."""
    folder = Path(folder)
    cfg = _hf_text_config(folder)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in _ARCH_BY_MODEL_TYPE:
        raise UnsupportedModelError(f"HF model_type {model_type!r} is not supported")
    arch = _ARCH_BY_MODEL_TYPE[model_type]
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias is not supported")
    num_heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    num_layers = int(cfg.num_hidden_layers)
    layer_types = tuple(getattr(cfg, "layer_types", None) or ["full_attention"] * num_layers)
    has_sliding = "sliding_attention" in layer_types
    rope, rope_local = _rope_specs(cfg, arch)
    is_gemma = arch == "gemma3"
    bos = getattr(cfg, "bos_token_id", None)
    pad = getattr(cfg, "pad_token_id", None)
    return ModelConfig(
        arch=arch,
        num_layers=num_layers,
        hidden=int(cfg.hidden_size),
        num_heads=num_heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        intermediate=int(cfg.intermediate_size),
        vocab=int(cfg.vocab_size),
        rope=rope,
        rope_local=rope_local,
        layer_types=layer_types,
        sliding_window=int(cfg.sliding_window) if has_sliding else None,
        norm_eps=float(cfg.rms_norm_eps),
        hidden_act=str(getattr(cfg, "hidden_activation", None) or cfg.hidden_act),
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar) if is_gemma else None,
        # transformers' Gemma 3 attention ignores attn_logit_softcapping, so we do too.
        attn_logit_softcap=None,
        final_logit_softcap=getattr(cfg, "final_logit_softcapping", None) if is_gemma else None,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(getattr(cfg, "attention_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_id=int(bos) if bos is not None else None,
        eos_ids=_eos_ids(folder, cfg),
        pad_id=int(pad) if pad is not None else None,
        max_position=int(getattr(cfg, "max_position_embeddings", 8192)),
        extra={"source": "hf", "model_type": model_type},
    )


def _param_name(hf_name: str) -> str | None:
    """HF tensor name -> our parameter name; None for tensors we do not use."""
    if hf_name == "lm_head.weight":
        return hf_name
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return None


def iter_hf_weights(
    folder: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, Tensor]]:
    """(our name, `dtype` tensor) for every decoder weight of a HF folder, one at a time."""
    from safetensors import safe_open
    from tqdm import tqdm

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in tqdm(
                list(f.keys()),
                desc=f"loading {file.name}",
                unit="tensor",
                file=sys.stderr,
                leave=False,
            ):
                name = _param_name(hf_name)
                if name is None or not name.startswith(_DECODER_PARTS):
                    continue  # vision tower, projector, ... of multimodal checkpoints
                if name == "lm_head.weight" and config.tie_embeddings:
                    continue
                yield name, f.get_tensor(hf_name).to(dtype)


def load_hf_weights(
    folder: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """All decoder weights of a HF folder as `dtype` tensors under our parameter names."""
    return dict(iter_hf_weights(folder, config, dtype))
