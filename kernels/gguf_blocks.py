"""Weights read from a GGUF's own blocks, as Q8_0 blocks for `kernels.q8_0`'s kernel.

Q8_0, Q5_0 and Q4_0 blocks hold 32 weights as d * q: one fp16 scale d and integers q of at
most 8 bits (Q8_0's int8; Q5_0's 5-bit and Q4_0's 4-bit values less 16 and 8). Widened to
int8, they are Q8_0 blocks of the same values, so the Q8_0 kernel multiplies the file's own
weights, at 1.125 bytes a weight against the 2 of an fp16 copy. Types with a per-block
minimum (Q4_1, Q5_1, Q4_K, Q5_K) or scales per 16 (Q6_K) are no such form: their linears
keep their float layout.

`head_blocks` reads a tied head stored as Q8_0 where the file keeps it (a copy-on-write
map: `Q8_0Weight.packed` reads it once). `iter_linear_blocks` reads, for every stacked projection
(`kernels.linear.STACKED_PROJECTIONS`: qkv, gate/up) whose parts are all stored so, the
parts' blocks with the loader's row order (`gguf_archs.row_order`, Llama's q and k),
stacked in the model's order. Where each tensor lies in the file is found once (reading a
large vocabulary's metadata takes seconds) and kept beside the file's other artifacts
(`tensor_locations`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kernels.gguf_archs import param_name, row_order, value_fixup
from kernels.linear import STACKED_PROJECTIONS
from kernels.q8_0 import BLOCK, Q8_0Weight

LOCATIONS_VERSION = 1  # of the cached `tensor_locations` record
# ggml type id -> bytes per block record, for the types that widen to Q8_0 exactly
Q8_0 = 8
Q5_0 = 6
Q4_0 = 2
RECORD_BYTES = {Q8_0: 34, Q5_0: 22, Q4_0: 18}


def widen(records: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., record bytes] blocks of `qtype` -> (int8 [..., 32] values, fp32 [...]
    scales) with values * scales the weights ggml dequantizes."""
    if records.shape[-1] != RECORD_BYTES.get(qtype):
        raise ValueError(f"ggml type {qtype} records of {records.shape[-1]} bytes")
    scales = np.ascontiguousarray(records[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q8_0:
        return np.ascontiguousarray(records[..., 2:]).view(np.int8), scales
    nibbles = records[..., -16:]  # value k in the low nibble of byte k, k + 16 in the high
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int16)
    if qtype == Q4_0:
        return (low - 8).astype(np.int8), scales
    high = np.ascontiguousarray(records[..., 2:6]).view("<u4")  # bit k: value k's fifth bit
    bits = (high >> np.arange(BLOCK, dtype=np.uint32)) & 1
    return (low + (bits.astype(np.int16) << 4) - 16).astype(np.int8), scales


def tensor_locations(path: Path) -> dict[str, list[int]]:
    """GGUF tensor name -> [byte offset, ggml type, rows, columns] for every 2-D tensor;
    cached in the file's artifact folder, stamped with its identity."""
    from kernels.gguf_loader import _atomic_write_text, artifact_dir, file_identity

    cache = artifact_dir(path) / "tensor_locations.json"
    stamp = f"{LOCATIONS_VERSION}:{file_identity(path)}"
    try:
        saved = json.loads(cache.read_text())
        if saved.get("stamp") == stamp:
            return dict(saved["where"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or stale: found again below
    import gguf

    where = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) == 2:
            cols, rows = (int(d) for d in t.shape)
            where[t.name] = [int(t.data_offset), int(t.tensor_type), rows, cols]
    _atomic_write_text(cache, json.dumps({"stamp": stamp, "where": where}))
    return where


def read_part(path: Path, where: list[int], name: str, config) -> Q8_0Weight:
    """One tensor's blocks (its model `name`), in the checkpoint's row order."""
    offset, qtype, rows, cols = where
    shape = (rows, cols // BLOCK, RECORD_BYTES[qtype])
    records = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)
    order = row_order(config, name, rows)
    q, scales = widen(records if order is None else records[order], qtype)
    return Q8_0Weight(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(scales))


def iter_linear_blocks(path: str | Path, config) -> Iterator[tuple[str, Q8_0Weight]]:
    """(stacked projection's module name, e.g. `layers.0.self_attn.qkv_proj`, its weight's
    blocks), one projection at a time, for each whose parts all widen to Q8_0 and need no
    value change."""
    path = Path(path)
    by_param = {}
    for gguf_name, place in tensor_locations(path).items():
        try:
            name = param_name(config.arch, gguf_name)
        except KeyError:
            continue
        if name and place[1] in RECORD_BYTES and place[3] % BLOCK == 0:
            if value_fixup(config.arch, name) is None:
                by_param[name] = place
    for layer in range(config.num_layers):
        for fused, parts in STACKED_PROJECTIONS.items():
            module = "self_attn" if fused == "qkv_proj" else "mlp"
            names = [f"layers.{layer}.{module}.{p}.weight" for p in parts]
            if all(n in by_param for n in names):
                read = [read_part(path, by_param[n], n, config) for n in names]
                yield (
                    f"layers.{layer}.{module}.{fused}",
                    Q8_0Weight(torch.cat([r.q for r in read]), torch.cat([r.scales for r in read])),
                )


def linear_blocks(path: str | Path, config) -> dict[str, Q8_0Weight]:
    """`iter_linear_blocks` as a dict (every projection's blocks at once)."""
    return dict(iter_linear_blocks(path, config))


def head_blocks(path: str | Path, config) -> Q8_0Weight | None:
    """The tied head of a GGUF whose embedding is stored as Q8_0, its values read in place;
    None for any other file (an untied head, another type, values the loader changes)."""
    path = Path(path)
    where = tensor_locations(path)
    table = where.get("token_embd.weight")
    if table is None or "output.weight" in where or table[1] != Q8_0 or table[3] % BLOCK:
        return None
    offset, _, v, h = table
    name = "embed_tokens.weight"
    if value_fixup(config.arch, name) is not None or row_order(config, name, v) is not None:
        return None
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(v, h // BLOCK, 34))
    scales = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    return Q8_0Weight(torch.from_numpy(raw[..., 2:].view(np.int8)), torch.from_numpy(scales))
