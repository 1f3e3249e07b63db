"""Tiny random-weight GGUF files written as llama.cpp's tools would write them.

Two parts:

* numpy encoders for the K-quants (Q4_K, Q5_K, Q6_K) in ggml's exact block layout. The `gguf`
  package only quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16/BF16; it dequantizes everything, and these
  encoders are the inverse of its `dequantize_blocks`. The scale choice is the simple one (per
  sub-block min/max, no iterative search as llama.cpp's `make_qkx2_quants` does), so the error is
  a little larger than llama-quantize's but the bytes mean the same thing.
* `write_tiny_gguf`: a tiny Llama / Qwen2 / Qwen3 built by HF transformers from a seed, written with
  the metadata keys, tensor names, q/k permutation, tensor types and tokenizer metadata that
  llama.cpp's `convert_hf_to_gguf.py` (and `llama-quantize` for the K-quants) would produce.
  The HF folder of the same weights is saved next to the GGUF for comparisons.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

QK_K = 256  # elements in a K-quant super-block
Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------- K-quant encoders


def _fp16(x: np.ndarray) -> np.ndarray:
    """The value as ggml stores it (fp16), back in float32."""
    return x.astype(np.float16).astype(np.float32)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.float32)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """ggml's 12-byte `scales` field of block_q4_K/q5_K: eight 6-bit scales and eight 6-bit mins.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 keep
    their low nibbles in bytes 8-11 (scale low, min high) and their top 2 bits in the top 2 bits
    of bytes 0-3 / 4-7 (inverse of `gguf.quants.Q4_K.get_scale_min`).
    """
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    m_d = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, m_d], axis=-1)


def _affine_subblocks(blocks: np.ndarray, nmax: int):
    """Per 32-element sub-block `x ~ d*sc*q - dmin*m`, q in [0, nmax], as block_q4_K/q5_K.

    The sub-block's range [min(x, 0), max(x)] is spread over the nmax+1 levels (ggml also clamps
    the min to at most 0, so that `m` is unsigned); the eight scales and mins are then quantized
    to 6 bits against the super-block's fp16 `d` and `dmin`. Returns (d, dmin, sc, m, q).
    """
    x = blocks.reshape(-1, QK_K // 32, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / nmax
    d = _fp16(scale.max(axis=-1, keepdims=True) / 63)
    dmin = _fp16(-lo.min(axis=-1, keepdims=True) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d)), 0, 63)
    m = np.clip(np.rint(_safe_div(-lo, dmin)), 0, 63)
    step = (d * sc)[..., None]
    offset = (dmin * m)[..., None]
    q = np.clip(np.rint(_safe_div(x + offset, step)), 0, nmax).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_nibbles_q4k(q: np.ndarray) -> np.ndarray:
    """128 bytes of 4-bit quants: byte j*32+l has sub-block 2j's element l in its low nibble and
    sub-block 2j+1's in its high nibble (`Q4_K.dequantize_blocks` shifts by [0, 4])."""
    q = q.reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """block_q4_K: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles (144 B)."""
    d, dmin, sc, m, q = _affine_subblocks(blocks, 15)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8),
            dmin.astype(np.float16).view(np.uint8),
            _pack_scale_min_k4(sc, m),
            _pack_nibbles_q4k(q),
        ],
        axis=-1,
    )


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K: as Q4_K plus 32 bytes `qh` before the nibbles, bit i of qh[l] being the 5th
    bit of sub-block i's element l (176 B)."""
    d, dmin, sc, m, q = _affine_subblocks(blocks, 31)
    high = (q >> 4) & 1  # [n, 8, 32]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    return np.concatenate(
        [
            d.astype(np.float16).view(np.uint8),
            dmin.astype(np.float16).view(np.uint8),
            _pack_scale_min_k4(sc, m),
            qh,
            _pack_nibbles_q4k(q),
        ],
        axis=-1,
    )


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """block_q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d (210 B).

    `x ~ d*scale[j]*(q-32)` per 16-element sub-block j, q in [0, 63]. As ggml, the element of
    largest magnitude maps to -32 (the end of the signed range with one more level). In each
    128-element half h, element 64*s+l keeps its low nibble in ql[64*h+l] (s=0 low, s=1 high
    nibble) and element 32*t+l its top 2 bits in qh[32*h+l] at bit 2*t.
    """
    x = blocks.reshape(-1, QK_K // 16, 16)
    at = np.abs(x).argmax(axis=-1)[..., None]
    scale = np.take_along_axis(x, at, axis=-1)[..., 0] / -32.0
    d = _fp16(np.abs(scale).max(axis=-1, keepdims=True) / 127)
    sc = np.clip(np.rint(_safe_div(scale, d)), -128, 127)
    step = (d * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(x, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # halves
    low = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2)
    return np.concatenate(
        [
            ql,
            qh.astype(np.uint8).reshape(-1, 64),
            sc.astype(np.int8).view(np.uint8),
            d.astype(np.float16).view(np.uint8),
        ],
        axis=-1,
    )


K_QUANT_ENCODERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}


def quantize_tensor(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`array` [rows, cols] float32 as ggml stores it in `qtype`.

    F32 / F16 come back as float32 / float16 arrays of the same shape; every block type as uint8
    of shape [rows, cols // block_size * type_size] (what `GGUFWriter.add_tensor(...,
    raw_dtype=qtype)` takes). gguf's own `gguf.quants.quantize` for the types it implements, the
    encoders above for Q4_K / Q5_K / Q6_K.
    """
    array = np.ascontiguousarray(array, dtype=np.float32)
    encoder = K_QUANT_ENCODERS.get(qtype)
    if encoder is None:
        return gguf.quants.quantize(array, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block_size:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block_size}: {array.shape}")
    blocks = encoder(array.reshape(-1, block_size))
    assert blocks.dtype == np.uint8 and blocks.shape[-1] == type_size
    return blocks.reshape(*array.shape[:-1], array.shape[-1] // block_size * type_size)


# --------------------------------------------------------------------------- tokenizers

TT = gguf.TokenType
SPM_SPACE = "\u2581"  # sentencepiece's word-boundary marker

# Pre-tokenizer regexes, as llama.cpp names them in `tokenizer.ggml.pre` (transformers maps the
# same names to the same regexes in `GGUF_PRE_TOKENIZER_SPLITS`).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's switch: with enable_thinking=false the template writes an empty reasoning block.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Mistral v0.1's [INST] format; a system message is folded into the next user turn.
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\\n\\n' %}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{%- set ns.system = '' %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)


class GgufVocab(dict):
    """The `tokenizer.*` metadata llama.cpp writes, keyed by field: model, pre, tokens,
    token_types, scores, merges, bos/eos/unk/pad ids, add_bos, add_space_prefix, chat_template."""


def _training_text() -> str:
    from actors.app.corpus import natural_text

    return natural_text()


def _merges_in_order(tokenizer) -> list[str]:
    """A trained BPE's merges as "left right" strings (the tokenizer.json / GGUF spelling)."""
    import json

    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def train_byte_level_bpe(split_regex: str, vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a GPT-2-style byte-level BPE trained on the local corpus.

    Tokens are spelled in GPT-2's byte alphabet (a space is "Ġ"), as llama.cpp copies them from
    tokenizer.json; the 256 single bytes are all in the vocabulary.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_training_text()], trainer)
    vocab = tokenizer.get_vocab()
    return sorted(vocab, key=vocab.__getitem__), _merges_in_order(tokenizer)


def byte_level_vocab(pre: str, specials: list[tuple[str, int]], template: str, **ids) -> GgufVocab:
    """A `tokenizer.ggml.model = "gpt2"` vocabulary: the trained BPE, then `specials` (token,
    token type) appended after it, as Qwen and Llama 3 number their added tokens."""
    split = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT}[pre]
    tokens, merges = train_byte_level_bpe(split, 600)
    types = [int(TT.NORMAL)] * len(tokens)
    for token, token_type in specials:
        tokens.append(token)
        types.append(int(token_type))
    index = {t: i for i, t in enumerate(tokens)}
    return GgufVocab(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=merges,
        chat_template=template,
        **{key: index[token] for key, token in ids.items()},
    )


def qwen_vocab(arch: str) -> GgufVocab:
    """Qwen2/Qwen3's shape: `<|endoftext|>` (bos and pad), `<|im_start|>`, `<|im_end|>` (eos of
    the instruct models) as control tokens; Qwen3 adds `<think>`/`</think>` as user-defined
    tokens. llama.cpp writes add_bos_token = false for Qwen."""
    specials = [
        ("<|endoftext|>", TT.CONTROL),
        ("<|im_start|>", TT.CONTROL),
        ("<|im_end|>", TT.CONTROL),
    ]
    if arch == "qwen3":
        specials += [("<think>", TT.USER_DEFINED), ("</think>", TT.USER_DEFINED)]
    template = QWEN3_TEMPLATE if arch == "qwen3" else CHATML_TEMPLATE
    vocab = byte_level_vocab(
        "qwen2",
        specials,
        template,
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
    )
    vocab["add_bos"] = False
    return vocab


def llama3_vocab() -> GgufVocab:
    """Llama 3's shape: byte-level BPE with pre "llama-bpe", `<|begin_of_text|>` (bos, added),
    `<|eot_id|>` (eos of the instruct models) and the header tokens as control tokens."""
    specials = [
        ("<|begin_of_text|>", TT.CONTROL),
        ("<|end_of_text|>", TT.CONTROL),
        ("<|start_header_id|>", TT.CONTROL),
        ("<|end_header_id|>", TT.CONTROL),
        ("<|eot_id|>", TT.CONTROL),
    ]
    vocab = byte_level_vocab(
        "llama-bpe",
        specials,
        LLAMA3_TEMPLATE,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
    )
    vocab["add_bos"] = True
    return vocab


def train_sentencepiece_bpe(vocab_size: int) -> tuple[list[str], list[str]]:
    """(merged pieces in merge order, single characters) of a sentencepiece-style BPE: words
    carry a leading "▁" for the space before them, and no piece crosses a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="always"
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tokenizer.train_from_iterator([_training_text()], trainer)
    merged = ["".join(m.split(" ")) for m in _merges_in_order(tokenizer)]
    chars = sorted(t for t in tokenizer.get_vocab() if len(t) == 1)
    return list(dict.fromkeys(merged)), chars


def spm_vocab() -> GgufVocab:
    """A Llama 2 / Mistral sentencepiece vocabulary as llama.cpp's `_create_vocab_sentencepiece`
    writes it (`tokenizer.ggml.model = "llama"`): `<unk>` (UNKNOWN), `<s>`, `</s>` (CONTROL), the
    byte-fallback tokens `<0x00>`..`<0xFF>` (BYTE), then the pieces, with scores.

    A BPE sentencepiece model scores a piece by its merge rank (higher merges first) and lists
    the single characters last; llama.cpp's tokenizer merges by score, and transformers rebuilds
    the merges from the scores (the file has none).
    """
    merged, chars = train_sentencepiece_bpe(420)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(TT.UNKNOWN), int(TT.CONTROL), int(TT.CONTROL)] + [int(TT.BYTE)] * 256
    scores = [0.0] * len(tokens)
    pieces = merged + [c for c in chars if c not in merged]
    tokens += pieces
    types += [int(TT.NORMAL)] * len(pieces)
    scores += [-float(rank) for rank in range(len(pieces))]
    return GgufVocab(
        model="llama",
        pre="default",
        tokens=tokens,
        token_types=types,
        scores=scores,
        unk=0,
        bos=1,
        eos=2,
        add_bos=True,
        add_eos=False,
        add_space_prefix=True,
        chat_template=MISTRAL_TEMPLATE,
    )


def make_vocab(arch: str, kind: str) -> GgufVocab:
    """The vocabulary for `arch` and tokenizer kind "bpe" (byte-level, Qwen or Llama 3 style)
    or "spm" (sentencepiece, Llama 2 / Mistral style; llama only)."""
    if kind == "spm":
        if arch != "llama":
            raise ValueError("a sentencepiece vocabulary goes with arch 'llama' only")
        return spm_vocab()
    if kind != "bpe":
        raise ValueError(f"tokenizer kind must be 'bpe' or 'spm', not {kind!r}")
    return llama3_vocab() if arch == "llama" else qwen_vocab(arch)


def write_vocab(writer: gguf.GGUFWriter, vocab: GgufVocab) -> None:
    """The `tokenizer.ggml.*` and `tokenizer.chat_template` keys, as llama.cpp's SpecialVocab."""
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["token_types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        if key in vocab:
            add(vocab[key])
    if "add_bos" in vocab:
        writer.add_add_bos_token(vocab["add_bos"])
    if "add_eos" in vocab:
        writer.add_add_eos_token(vocab["add_eos"])
    if "add_space_prefix" in vocab:
        writer.add_add_space_prefix(vocab["add_space_prefix"])
    writer.add_chat_template(vocab["chat_template"])


# --------------------------------------------------------------------------- the model

ARCHS = ("llama", "qwen2", "qwen3")
# Random weights: the linears at INIT_STD keep attention soft (q.k logits of std ~2), so the model
# does not amplify a small weight change much; the embedding and lm_head at EMBED_STD, far above
# HF's 0.02, make the next-token distribution peaked enough for greedy decoding to be stable.
INIT_STD = 0.08
EMBED_STD = 0.3
HIDDEN = 256  # every linear's input width is a multiple of 256, as the K-quants need
INTERMEDIATE = 512
NUM_HEADS = 4
# != HIDDEN / NUM_HEADS, so the file states attention.key_length; and 128 because transformers'
# GGUF loader ignores qwen3.attention.key_length and takes Qwen3Config's default head_dim, 128.
QWEN3_HEAD_DIM = 128
ROPE_THETA = {"llama": 500000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}
RMS_EPS = {"llama": 1e-5, "qwen2": 1e-6, "qwen3": 1e-6}
TIED_BY_DEFAULT = {"llama": False, "qwen2": True, "qwen3": False}

# weight_type -> (type of the 2-D tensors, general.file_type). Q4_K/Q5_K are all-K files, as
# `llama-quantize --pure` makes them (labelled _S); "Q4_K_M" is llama-quantize's mix.
WEIGHT_TYPES = {
    "F32": (Q.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q5_0": (Q.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "Q4_K": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
    "Q5_K": (Q.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_S),
    "Q6_K": (Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
    "Q4_K_M": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
}

# HF parameter name (after "model.layers.N.") -> llama.cpp's name (after "blk.N.").
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def hf_config(
    arch: str,
    vocab: GgufVocab,
    *,
    num_layers: int,
    num_key_value_heads: int,
    tie_word_embeddings: bool,
    context_length: int,
):
    """The transformers config of the tiny model: hidden 256, 4 heads (head_dim 64; Qwen3 128),
    intermediate 512. Qwen2 has q/k/v biases, Qwen3 q/k norms, Llama neither."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=len(vocab["tokens"]),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=context_length,
        rms_norm_eps=RMS_EPS[arch],
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA[arch]},
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=INIT_STD,
        bos_token_id=vocab.get("bos"),
        eos_token_id=vocab.get("eos"),
        pad_token_id=vocab.get("pad"),
    )
    if arch == "llama":
        return LlamaConfig(**common, head_dim=HIDDEN // NUM_HEADS)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=QWEN3_HEAD_DIM)
    raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")


def build_hf_model(config, seed: int):
    """The HF model with seeded random weights, in float32.

    HF initialises norms to 1 and biases to 0, which would hide a swapped norm or a missing bias;
    these get random values too (norms 1 +- 0.2, biases std 0.5). The embedding and lm_head are
    redrawn at EMBED_STD.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                param.copy_(EMBED_STD * torch.randn_like(param))
    return model


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a HF parameter name (what gguf-py's TensorNameMap gives)."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    prefix, layer, rest = stem.split(".", 3)[1:]
    assert prefix == "layers", hf_name
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` for q_proj (n_head) and k_proj (n_head_kv): each head's
    rows go from HF's rotate-half order (first half, second half) to interleaved pairs, the
    order of GGML's "normal" rope. transformers undoes it in `_reverse_permute_weights`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp name -> float32 array, for every tensor `convert_hf_to_gguf.py` writes.

    The output projection is left out when it is tied to the embedding (the HF checkpoint has no
    lm_head then). Only arch "llama" has its q/k weights permuted: llama.cpp's Qwen2/Qwen3
    converters use the NEOX rope and write them as HF has them.
    """
    config = model.config
    out = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy().copy()
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            array = llama_permute(array, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            array = llama_permute(array, config.num_attention_heads, config.num_key_value_heads)
        out[gguf_name(hf_name)] = array
    return out


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's `use_more_bits`: the first and last eighth of the layers, and every
    third one between, get the bigger type in the _M mixes."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def tensor_type(
    name: str, weight_type: str, n_layers: int, tied: bool
) -> gguf.GGMLQuantizationType:
    """The ggml type of tensor `name` in a file of `weight_type`.

    1-D tensors (norms, biases) stay F32, as both convert_hf_to_gguf.py and llama-quantize keep
    them. Every 2-D tensor, the token embedding included, is `weight_type`, except in "Q4_K_M"
    where llama-quantize makes the output (the token embedding when tied) Q6_K, and attn_v and
    ffn_down Q6_K on the layers `_use_more_bits` picks.
    """
    if not name.endswith(".weight") or "norm" in name:
        return Q.F32
    qtype = WEIGHT_TYPES[weight_type][0]
    if weight_type != "Q4_K_M":
        return qtype
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q.Q6_K
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down"):
        if _use_more_bits(int(name.split(".")[1]), n_layers):
            return Q.Q6_K
    return qtype


def head_dim_of(config) -> int:
    """The attention head width (Qwen2's config has no head_dim: hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_hparams(writer: gguf.GGUFWriter, arch: str, config, name: str, file_type: int) -> None:
    """The `general.*` and `{arch}.*` keys of convert_hf_to_gguf.py's `set_gguf_parameters`.

    key_length / value_length only where the head dim is not hidden / heads (as a config without
    an explicit head_dim gives); rope.dimension_count is the head dim (the whole head rotates).
    Llama's converter also writes `llama.vocab_size`.
    """
    head_dim = head_dim_of(config)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_tiny_gguf(
    path: str | Path,
    arch: str,
    weight_type: str = "F32",
    seed: int = 0,
    *,
    tokenizer: str = "bpe",
    num_layers: int = 2,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool | None = None,
    context_length: int = 4096,
    save_hf: bool = True,
) -> dict:
    """Write a tiny random-weight `arch` model to the GGUF file `path`, as llama.cpp would.

    arch: "llama" (also Llama 2 / Mistral / Llama 3), "qwen2" or "qwen3".
    weight_type: one of `WEIGHT_TYPES` (F32 F16 BF16 Q8_0 Q4_0 Q4_K Q5_K Q6_K Q4_K_M).
    tokenizer: "bpe" (byte-level: Qwen's for qwen*, Llama 3's for llama) or "spm" (Llama 2 /
      Mistral sentencepiece with byte fallback; llama only).
    tie_word_embeddings: default per arch (llama untied, qwen2 tied, qwen3 untied).

    Files: `path` itself, and with save_hf the same weights as a HF folder
    `<path without .gguf>-hf/` (config.json, model.safetensors in float32, and the tokenizer
    transformers reads from the GGUF, with its chat template). Returns a dict: gguf_path,
    folder (the GGUF's directory), gguf_file (its name), hf_dir (None without save_hf), arch,
    weight_type, tokenizer, config (the transformers config), model (the HF model, float32,
    eval), tensor_types (llama.cpp name -> GGMLQuantizationType), vocab (the GgufVocab written:
    tokens, types, merges/scores, special ids, chat_template), head_dim.
    """
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {sorted(WEIGHT_TYPES)}, not {weight_type!r}")
    if tie_word_embeddings is None:
        tie_word_embeddings = TIED_BY_DEFAULT[arch]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = make_vocab(arch, tokenizer)
    config = hf_config(
        arch,
        vocab,
        num_layers=num_layers,
        num_key_value_heads=num_key_value_heads,
        tie_word_embeddings=tie_word_embeddings,
        context_length=context_length,
    )
    model = build_hf_model(config, seed)

    name = f"tiny-random-{arch}-{tokenizer}"
    writer = gguf.GGUFWriter(path, arch)
    write_hparams(writer, arch, config, name, WEIGHT_TYPES[weight_type][1])
    write_vocab(writer, vocab)
    types = {}
    for tensor_name, array in gguf_tensors(model, arch).items():
        qtype = tensor_type(tensor_name, weight_type, num_layers, tie_word_embeddings)
        types[tensor_name] = qtype
        data = quantize_tensor(array, qtype)
        writer.add_tensor(tensor_name, data, raw_dtype=None if data.dtype != np.uint8 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    hf_dir = None
    if save_hf:
        hf_dir = path.with_name(path.stem + "-hf")
        model.save_pretrained(hf_dir)
        save_gguf_tokenizer(path, hf_dir)
    return dict(
        gguf_path=path,
        folder=path.parent,
        gguf_file=path.name,
        hf_dir=hf_dir,
        arch=arch,
        weight_type=weight_type,
        tokenizer=tokenizer,
        config=config,
        model=model,
        tensor_types=types,
        vocab=vocab,
        head_dim=head_dim_of(config),
    )


def save_gguf_tokenizer(gguf_path: Path, hf_dir: Path) -> None:
    """Save the tokenizer transformers builds from the GGUF into the HF folder, so that the
    folder is a whole model too (tokenizer.json, tokenizer_config.json with the chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(hf_dir)


def dequantized_model(info: dict):
    """A copy of the HF model of `write_tiny_gguf`'s `info` holding the values the GGUF holds:
    each tensor through `quantize_tensor` and gguf's dequantizer in its file type. (Blocks lie
    within a row, so the llama q/k row permutation does not change what a row's values become.)
    """
    import copy

    import torch

    model = copy.deepcopy(info["model"])
    types = info["tensor_types"]
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            if hf_name == "lm_head.weight" and tied:
                continue
            qtype = types[gguf_name(hf_name)]
            array = param.detach().numpy()
            values = gguf.quants.dequantize(quantize_tensor(array, qtype), qtype)
            param.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(array.shape)))
    return model


def write_foreign_gguf(path: str | Path, arch: str = "phi3") -> Path:
    """A minimal GGUF of an architecture kvactor does not serve (one block count, one
    embedding tensor): enough for a loader to read its metadata and refuse it."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
