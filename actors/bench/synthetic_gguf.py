"""`bin/engine bench synthetic-gguf OUT.gguf`: a GGUF with a real model's shapes and random
values, to measure what loading and serving such a model takes without downloading it.

The default shape is Llama 3.1 8B's (`--shape llama-8b`), stored as llama.cpp's Q4_K_M mix
(Q6_K for the output, for `attn_v` and for `ffn_down` on the layers its `use_more_bits`
picks, Q4_K for every other matrix, F32 norms). Quantized blocks are random bytes with small
valid fp16 scales (no encoding: the values do not matter, only their layout and size), and
the file is written tensor by tensor (`GGUFWriter.write_tensor_data`), so writing it never
holds more than one tensor. The vocabulary is placeholder tokens: the file serves
`bin/engine bench model --model OUT.gguf`, which needs shapes, not text.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SHAPES = {
    "llama-8b": dict(
        layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256
    ),
    "qwen2.5-7b": dict(
        layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064
    ),
    "tiny": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1024),
}


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v / ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random blocks of `qtype` whose fp16 scales are small and
    finite (Q4_K: d and dmin at bytes 0-3 of each 144-byte block; Q6_K: d at its last 2)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    else:  # Q6_K
        blocks[:, -2:] = scale
    return blocks.reshape(rows, -1)


def tensors(shape: dict[str, int]):
    """(llama.cpp name, [rows, cols] or [n], GGML type) of the model, in file order."""
    from gguf import GGMLQuantizationType as T

    h, i, n = shape["hidden"], shape["intermediate"], shape["layers"]
    head_dim = h // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    yield "token_embd.weight", (shape["vocab"], h), T.Q4_K
    for layer in range(n):
        more = T.Q6_K if _use_more_bits(layer, n) else T.Q4_K
        for name, dims, qtype in (
            ("attn_norm", (h,), T.F32),
            ("attn_q", (h, h), T.Q4_K),
            ("attn_k", (kv, h), T.Q4_K),
            ("attn_v", (kv, h), more),
            ("attn_output", (h, h), T.Q4_K),
            ("ffn_norm", (h,), T.F32),
            ("ffn_gate", (i, h), T.Q4_K),
            ("ffn_up", (i, h), T.Q4_K),
            ("ffn_down", (h, i), more),
        ):
            yield f"blk.{layer}.{name}.weight", dims, qtype
    yield "output_norm.weight", (h,), T.F32
    yield "output.weight", (shape["vocab"], h), T.Q6_K


def write(path: str, shape: dict[str, int], seed: int = 0) -> int:
    """Write the synthetic GGUF; returns its size in bytes."""
    import gguf

    rng = np.random.default_rng(seed)
    arch = "llama"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("synthetic")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list([f"t{k}" for k in range(shape["vocab"])])
    writer.add_token_types([gguf.TokenType.NORMAL] * shape["vocab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    specs = list(tensors(shape))
    for name, dims, qtype in specs:
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims)) // block * size
            rows, cols = dims
            writer.add_tensor_info(
                name, (rows, cols // block * size), np.dtype(np.uint8), nbytes, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, qtype in specs:
        if qtype == gguf.GGMLQuantizationType.F32:
            data = (1.0 + 0.01 * rng.standard_normal(dims)).astype(np.float32)
        else:
            data = _random_blocks(qtype, *dims, rng)
        writer.write_tensor_data(data)
    writer.close()
    from pathlib import Path

    return Path(path).stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="bin/engine bench synthetic-gguf", description=__doc__.split("\n")[0]
    )
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's")
    args = ap.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["layers"] = args.layers
    start = time.perf_counter()
    size = write(args.out, shape)
    print(
        f"wrote {args.out}: {args.shape} ({shape['layers']} layers), Q4_K_M mix, "
        f"{size / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s"
    )
    return 0
