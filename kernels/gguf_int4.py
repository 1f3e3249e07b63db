"""GGUF 4-bit blocks straight into `kernels.quant`'s int4 layout, with no float detour.

Q4_0, Q4_1 and Q4_K store, per group of 32 input channels, 4-bit codes q in [0, 15] and an
affine map; `kernels.quant` stores w ~ (q - 8) * scale + zero per group of 32 (its
`INT4_GROUP`). So the codes carry over unchanged and only the map is rewritten:

  * Q4_0 (block of 32):  w = d * (q - 8)                 -> scale d, zero 0
  * Q4_1 (block of 32):  w = d * q + m                   -> scale d, zero m + 8 d
  * Q4_K (256 = 8 x 32): w = (d * sc_j) * q - dmin * m_j -> scale d sc_j, zero 8 d sc_j - dmin m_j

The block layouts are ggml's, read as `gguf.quants`' dequantizers read them (a test checks
that `kernels.quant.dequantize_groups` of the result equals `gguf.quants.dequantize`). The
only rounding is the scale and zero's, to the dtype the kernel takes them in (none in fp32).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from kernels.quant_layout import INT4_GROUP

_QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)  # [blocks, 1]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Codes of packed bytes [blocks, n]: each run of `run` bytes gives its low nibbles,
    then its high nibbles (ggml's order) -> uint8 [blocks, 2 n]."""
    blocks = qs.shape[0]
    halves = qs.reshape(blocks, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (halves & np.uint8(0x0F)).reshape(blocks, -1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 16), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:], 16), d, m + 8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # 6-bit per-sub-block scales and mins
    scale = d * sc.astype(np.float32)  # [n, 8]
    zero = 8 * scale - dmin * m.astype(np.float32)
    codes = _nibbles(blocks[:, 16:], 32)  # [n, 256]
    return codes.reshape(n * 8, INT4_GROUP), scale.reshape(-1, 1), zero.reshape(-1, 1)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def int4_part(tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A 2-D GGUF tensor of a `INT4_BLOCK_TYPES` type as `kernels.quant.quantize_part`'s
    int4 output: (codes uint8 [out, in], scales_zeros [in / 32, out, 2] in `scale_dtype`)."""
    from gguf import GGML_QUANT_SIZES

    kind = tensor.tensor_type.name
    out_features, in_features = (int(d) for d in reversed(tensor.shape))
    _, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = np.asarray(tensor.data).reshape(-1, block_bytes)
    codes, scale, zero = _DECODERS[kind](blocks)
    groups = in_features // INT4_GROUP
    codes = codes.reshape(out_features, in_features)
    scales_zeros = np.concatenate([scale, zero], axis=1).reshape(out_features, groups, 2)
    return (
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(scales_zeros.transpose(1, 0, 2))).to(scale_dtype),
    )
