"""The GPU check's random-weights model has the embedded model's shapes, so its timings are
those of the real model's size; its tokenizer decodes every id the model can emit."""

from __future__ import annotations

from actors.bench.random_model import GEMMA3_270M, SPECIALS, word_vocab
from kernels.models import load_config


def test_shapes_are_the_embedded_gguf_ones():
    real = load_config(None)
    cfg = GEMMA3_270M
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        real.vocab,
        real.hidden,
        real.intermediate,
    )
    assert cfg["num_hidden_layers"] == real.num_layers
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        real.num_heads,
        real.num_kv_heads,
        real.head_dim,
    )
    assert tuple(cfg["layer_types"]) == real.layer_types
    assert cfg["sliding_window"] == real.sliding_window
    assert cfg["query_pre_attn_scalar"] == real.query_pre_attn_scalar
    rope = cfg["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] == real.rope.theta
    assert rope["sliding_attention"]["rope_theta"] == real.rope_local.theta
    assert (cfg["bos_token_id"], cfg["pad_token_id"]) == (real.bos_id, real.pad_id)
    assert cfg["eos_token_id"] in real.eos_ids


def test_vocabulary_covers_every_id():
    vocab = word_vocab("The cat sat. The dog, too!", 64)
    assert len(vocab) == 64 and sorted(vocab.values()) == list(range(64))
    assert [vocab[s] for s in SPECIALS] == [0, 1, 2, 3]
    assert {"The", "cat", ".", ",", "!"} <= set(vocab)
