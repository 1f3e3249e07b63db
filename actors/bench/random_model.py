"""A Gemma 3 270M-shaped model with seeded random weights, saved once as a HF folder.

`gpu-check --random-weights` uses it so that parity and throughput need no model carried to
the GPU machine: the folder (config.json, model.safetensors in bf16, a word-level
tokenizer over the bench corpus) is written by HF transformers from a seed, then loaded
identically by kvactor's HF-folder loader and by transformers, so both run the same
numbers. The shapes are the embedded GGUF's (`GEMMA3_270M`; a test checks them against
it), so the timings are those of the real model's size. `INIT_STD` is larger than HF's
default initializer range so that a random model's next-token distribution is peaked
enough for greedy decoding to be stable and for logprob comparisons to mean something.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

GEMMA3_270M = dict(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    sliding_window=512,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    hidden_activation="gelu_pytorch_tanh",
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=True,
)
INIT_STD = 0.06
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3, as in Gemma's vocabulary
FOLDER_VERSION = 1  # bump when what is written changes


def word_vocab(text: str, size: int) -> dict[str, int]:
    """Specials first, then every distinct word and punctuation mark of `text`, then filler
    tokens up to `size`, so that every id the model can emit decodes."""
    words = sorted(set(re.findall(r"\w+|[^\w\s]", text)))
    tokens = SPECIALS + words
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    return {tok: i for i, tok in enumerate(tokens)}


def write_tokenizer(folder: Path, text: str, size: int) -> None:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel(word_vocab(text, size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    )


def random_gemma3_folder(cache_dir: str | Path, seed: int = 0) -> Path:
    """The folder of the seeded random model under `cache_dir`, written on first use."""
    folder = Path(cache_dir) / f"random-gemma3-270m-seed{seed}-v{FOLDER_VERSION}"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from actors.app.corpus import natural_text

    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config = Gemma3TextConfig(**GEMMA3_270M, initializer_range=INIT_STD)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    write_tokenizer(tmp, natural_text(), config.vocab_size)
    tmp.rename(folder)
    return folder
