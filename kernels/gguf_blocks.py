"""Weights read from a GGUF's own blocks, as int8 blocks for `kernels.q8_0`'s kernel.

Q8_0, Q5_0 and Q4_0 blocks hold 32 weights as d * q: one fp16 scale d and integers q of at
most 8 bits (Q8_0's int8; Q5_0's 5-bit and Q4_0's 4-bit values less 16 and 8). Widened to
int8, they are Q8_0 blocks of the same values (`widen`). Two K-quants read the same way
with a little more per block (`widen_k`): Q4_K's sub-blocks of 32 carry a scale and a
minimum (w = d * sc * q - dmin * m, q in [0, 15]), Q6_K's sub-blocks of 16 a scale each
(w = d * sc * q, q in [-32, 31]); the kernel takes both kinds. Either way it multiplies the
file's own weights, at 1.0625 to 1.25 bytes a weight against the 2 of an fp16 copy. Q4_1,
Q5_1, Q5_K and Q2_K/Q3_K are not read so: their linears keep their float layout.

`head_blocks` reads a tied head stored as Q8_0 where the file keeps it (a copy-on-write
map: `Q8_0Weight.packed` reads it once). `iter_linear_blocks` reads every projection (the
stacked qkv and gate/up of `kernels.linear.STACKED_PROJECTIONS`, the single o and down)
whose parts are all of those types, with the loader's row order (`gguf_archs.row_order`,
Llama's q and k), parts stacked in the model's order (`stacked`: parts of different kinds
in one that holds each). Where each tensor lies in the file is found once (reading a large
vocabulary's metadata takes seconds) and kept beside the file's other artifacts
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
# ggml type id -> bytes per block record (of 32 weights; 256 for the K-quants), for the
# types `widen` reads exactly
Q8_0 = 8
Q5_0 = 6
Q4_0 = 2
Q4_K = 12
Q6_K = 14
RECORD_BYTES = {Q8_0: 34, Q5_0: 22, Q4_0: 18, Q4_K: 144, Q6_K: 210}
K_QUANTS = (Q4_K, Q6_K)
SUPER = 256  # weights a K-quant record holds
# the model's linears whose weights are read as blocks: stacked projections, then single ones
SINGLE_PROJECTIONS = {"o_proj": "self_attn", "down_proj": "mlp"}


def widen(records: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., record bytes] blocks of Q8_0, Q5_0 or Q4_0 -> (int8 [..., 32] values,
    fp32 [...] scales) with values * scales the weights ggml dequantizes."""
    if records.shape[-1] != RECORD_BYTES.get(qtype) or qtype in K_QUANTS:
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


def widen_k(records: np.ndarray, qtype: int) -> Q8_0Weight:
    """uint8 [rows, n, record bytes] Q4_K or Q6_K records (n of 256 weights a row) -> the
    same weights as 32-blocks: Q4_K's sub-blocks of 32 with a scale and a minimum each
    (d * sc * q - dmin * m, q in [0, 15]); Q6_K's sub-blocks of 16 with a scale each
    (d * sc * q, q in [-32, 31]). The arithmetic is gguf-py's own (`gguf.quants`), so
    `dequantized` gives the values its `dequantize` does, bit for bit."""
    from gguf.quants import Q4_K as Q4K

    rows, n, size = records.shape
    if size != RECORD_BYTES.get(qtype) or qtype not in K_QUANTS:
        raise ValueError(f"ggml type {qtype} records of {size} bytes")
    flat = records.reshape(rows * n, size)
    if qtype == Q4_K:
        d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)  # [N, 1]
        dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4K.get_scale_min(flat[:, 4:16].copy())  # [N, 8] each
        scales = d * sc.astype(np.float32)
        mins = dmin * m.astype(np.float32)
        # 64 values a group: the low nibbles of 32 bytes, then their high nibbles
        qs = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).astype(np.int8).reshape(rows, n * 8, 32)
        return Q8_0Weight(
            torch.from_numpy(q),
            torch.from_numpy(scales.reshape(rows, n * 8)),
            torch.from_numpy(mins.reshape(rows, n * 8)),
        )
    ql, qh, sc = flat[:, :128], flat[:, 128:192], flat[:, 192:208]
    d = flat[:, 208:210].copy().view(np.float16).astype(np.float32)
    scales = d * sc.copy().view(np.int8).astype(np.float32)  # [N, 16]: one a 16 values
    low = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(-1, 4, 32)
    high = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(-1, 4, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return Q8_0Weight(
        torch.from_numpy(np.ascontiguousarray(q.reshape(rows, n * 8, 32))),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, n * 8, 2))),
    )


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
    per = SUPER if qtype in K_QUANTS else BLOCK
    shape = (rows, cols // per, RECORD_BYTES[qtype])
    records = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)
    order = row_order(config, name, rows)
    records = records if order is None else records[order]
    if qtype in K_QUANTS:
        return widen_k(np.asarray(records), qtype)
    q, scales = widen(records, qtype)
    return Q8_0Weight(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(scales))


def stacked(parts: list[Q8_0Weight]) -> Q8_0Weight:
    """Parts' blocks stacked along the rows; parts of different kinds in the kind that holds
    each (scales per 16 where any has them, minimums (zero elsewhere) where any has them)."""
    if len(parts) == 1:
        return parts[0]
    subblocks = max(p.subblocks for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    scales, mins = [], []
    for p in parts:
        s = p.scales
        scales.append(s[..., None].expand(*s.shape, 2) if subblocks > p.subblocks else s)
        if with_mins:
            none = torch.zeros(p.scales.shape[:2], dtype=torch.float32)
            mins.append(p.mins if p.mins is not None else none)
    return Q8_0Weight(
        torch.cat([p.q for p in parts]),
        torch.cat(scales).contiguous(),
        torch.cat(mins) if with_mins else None,
    )


def iter_linear_blocks(path: str | Path, config) -> Iterator[tuple[str, Q8_0Weight]]:
    """(projection's module name, e.g. `layers.0.self_attn.qkv_proj`, its weight's blocks),
    one projection at a time: the stacked ones (qkv, gate/up) and the single ones (o, down,
    `SINGLE_PROJECTIONS`) whose parts are all of a type `read_part` reads and need no value
    change."""
    path = Path(path)
    by_param = {}
    for gguf_name, place in tensor_locations(path).items():
        try:
            name = param_name(config.arch, gguf_name)
        except KeyError:
            continue
        per = SUPER if place[1] in K_QUANTS else BLOCK
        if name and place[1] in RECORD_BYTES and place[3] % per == 0:
            if value_fixup(config.arch, name) is None:
                by_param[name] = place
    projections = {
        **{
            fused: ("self_attn" if fused == "qkv_proj" else "mlp", parts)
            for fused, parts in STACKED_PROJECTIONS.items()
        },
        **{single: (module, (single,)) for single, module in SINGLE_PROJECTIONS.items()},
    }
    for layer in range(config.num_layers):
        for fused, (module, parts) in projections.items():
            names = [f"layers.{layer}.{module}.{p}.weight" for p in parts]
            if all(n in by_param for n in names):
                read = [read_part(path, by_param[n], n, config) for n in names]
                yield f"layers.{layer}.{module}.{fused}", stacked(read)


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
