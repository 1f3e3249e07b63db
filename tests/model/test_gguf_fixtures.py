"""The tiny-GGUF fixtures (tests/model/gguf_fixtures.py) against gguf-py and HF transformers.

The K-quant encoders are checked through gguf's own dequantizer (round-trip error within what
the bit width allows, right byte sizes, each sub-block keeping its own scale). The written files
are checked by loading them with transformers' GGUF support, which follows llama.cpp's names,
metadata and q/k permutation: an F32 file must give the source model's logits, a quantized one
the logits of the source model holding the dequantized values, and the tokenizer transformers
builds from the metadata must round-trip text and carry the chat template.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.model.gguf_fixtures import (
    K_QUANT_ENCODERS,
    Q,
    dequantized_model,
    head_dim_of,
    quantize_tensor,
    write_tiny_gguf,
)

pytestmark = pytest.mark.model

# Relative RMS error of dequantize(quantize(w)) for Gaussian w. Measured (seed 0): Q8_0 0.54%,
# Q4_0 8.6%, Q4_K 7.85%, Q5_K 3.83%, Q6_K 1.88%; a wrong bit layout gives tens of percent.
ROUND_TRIP_BOUNDS = {Q.Q8_0: 0.006, Q.Q4_0: 0.09, Q.Q6_K: 0.020, Q.Q5_K: 0.040, Q.Q4_K: 0.080}
# The same, each 32-element sub-block scaled by its own factor in [1/16, 1] and the error
# measured relative to that factor. Measured: Q4_K 8.07%, Q5_K 4.18%, Q6_K 1.98%.
SUB_BLOCK_BOUNDS = {Q.Q6_K: 0.022, Q.Q5_K: 0.045, Q.Q4_K: 0.085}
# Where each K-quant block keeps its packed quants (the nibbles swapped by the negative test).
QUANT_BYTES = {Q.Q4_K: slice(16, 144), Q.Q5_K: slice(48, 176), Q.Q6_K: slice(0, 128)}

# The written models: Llama 2/Mistral-style (sentencepiece, GQA 4/2, untied), Llama 3-style
# (byte-level BPE, MHA 4/4, tied), Qwen2 (q/k/v biases, tied), Qwen3 (q/k norms, head_dim 128).
VARIANTS = {
    "llama-spm": dict(arch="llama", tokenizer="spm"),
    "llama-bpe": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
}
PROMPT = [1, 5, 17, 42, 99, 123, 250, 301, 7, 400, 555, 64, 3, 3, 590]
TEXTS = [
    "Hello world, this is a test.",
    "The parser handles optional and positional arguments!",
    "numbers 12345 and café ☕ with émoji",
    "line one\nline  two\t tab",
]


def gaussian(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def rel_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(((approx - exact) ** 2).mean() / (exact**2).mean()))


def round_trip(w: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(quantize_tensor(w, qtype), qtype).reshape(w.shape)


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUNDS), ids=lambda q: q.name)
def test_round_trip_of_gaussian_weights_is_within_the_bit_width(qtype):
    w = gaussian(128, 1024)
    data = quantize_tensor(w, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8
    assert data.shape == (128, 1024 // block_size * type_size)
    assert rel_rms(round_trip(w, qtype), w) < ROUND_TRIP_BOUNDS[qtype]


@pytest.mark.parametrize("qtype", list(K_QUANT_ENCODERS), ids=lambda q: q.name)
def test_each_sub_block_keeps_its_own_scale(qtype):
    rng = np.random.default_rng(1)
    w = gaussian(64, 2048, seed=2)
    scale = np.exp(rng.uniform(np.log(1 / 16), 0, size=(64, 2048 // 32))).repeat(32, axis=1)
    scaled = w * scale.astype(np.float32)
    error = rel_rms(round_trip(scaled, qtype) / scale, w)
    assert error < SUB_BLOCK_BOUNDS[qtype]


@pytest.mark.parametrize("qtype", list(K_QUANT_ENCODERS), ids=lambda q: q.name)
def test_the_bounds_catch_a_wrong_nibble_order(qtype):
    w = gaussian(16, 512)
    blocks = quantize_tensor(w, qtype).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]).copy()
    packed = blocks[:, QUANT_BYTES[qtype]]
    blocks[:, QUANT_BYTES[qtype]] = (packed >> 4) | (packed << 4)
    wrong = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
    assert rel_rms(wrong, w) > 5 * ROUND_TRIP_BOUNDS[qtype]


def test_quantize_tensor_uses_gguf_where_gguf_can():
    w = gaussian(4, 512)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.BF16):
        assert np.array_equal(quantize_tensor(w, qtype), gguf.quants.quantize(w, qtype))
    assert quantize_tensor(w, Q.F16).dtype == np.float16
    assert np.array_equal(quantize_tensor(w, Q.F32), w)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_tensor(gaussian(2, 96), Q.Q4_K)


# --------------------------------------------------------------------------- written models


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """written(variant, weight_type) -> write_tiny_gguf's dict, each file written once."""
    cache = {}

    def get(variant: str, weight_type: str = "F32") -> dict:
        if (variant, weight_type) not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{weight_type}")
            cache[variant, weight_type] = write_tiny_gguf(
                folder / "model.gguf", weight_type=weight_type, **VARIANTS[variant]
            )
        return cache[variant, weight_type]

    return get


def logits(model, ids=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def transformers_model(info: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        info["folder"], gguf_file=info["gguf_file"], dtype=torch.float32
    ).eval()


def transformers_tokenizer(info: dict):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(info["folder"], gguf_file=info["gguf_file"])


def expected_tensor_names(arch: str, layers: int, tied: bool) -> set[str]:
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    per_layer += ["ffn_gate", "ffn_up", "ffn_down"]
    if arch == "qwen3":
        per_layer += ["attn_q_norm", "attn_k_norm"]
    names = {f"blk.{i}.{n}.weight" for i in range(layers) for n in per_layer}
    if arch == "qwen2":
        names |= {f"blk.{i}.attn_{p}.bias" for i in range(layers) for p in "qkv"}
    names |= {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})
    return names


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_and_tensor_names_are_llama_cpps(written, variant):
    info = written(variant)
    arch, config = info["arch"], info["config"]
    reader = gguf.GGUFReader(info["gguf_path"])
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == arch
    assert field("general.file_type") == gguf.LlamaFileType.ALL_F32
    assert field(f"{arch}.embedding_length") == 256
    assert field(f"{arch}.block_count") == config.num_hidden_layers
    assert field(f"{arch}.feed_forward_length") == 512
    assert field(f"{arch}.attention.head_count") == 4
    assert field(f"{arch}.attention.head_count_kv") == config.num_key_value_heads
    assert field(f"{arch}.rope.dimension_count") == info["head_dim"]
    assert field(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(config.rms_norm_eps)
    has_key_length = f"{arch}.attention.key_length" in reader.fields
    assert has_key_length == (arch == "qwen3")  # head_dim 128 != 256 / 4
    assert len(field("tokenizer.ggml.tokens")) == config.vocab_size
    assert field("tokenizer.chat_template") == info["vocab"]["chat_template"]

    tied = config.tie_word_embeddings
    names = {t.name for t in reader.tensors}
    assert names == expected_tensor_names(arch, config.num_hidden_layers, tied)
    for t in reader.tensors:
        assert t.tensor_type == Q.F32
    # llama.cpp permutes q/k rows for Llama only (its Qwen converters use the NEOX rope)
    q_file = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    q_hf = info["model"].model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(q_file, q_hf) == (arch != "llama")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_reads_the_f32_file_as_the_source_model(written, variant):
    info = written(variant)
    loaded = transformers_model(info)
    source = info["config"]
    assert loaded.config.num_key_value_heads == source.num_key_value_heads
    assert head_dim_of(loaded.config) == info["head_dim"]
    assert loaded.config.tie_word_embeddings == source.tie_word_embeddings
    assert loaded.config.vocab_size == source.vocab_size
    torch.testing.assert_close(logits(loaded), logits(info["model"]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_builds_the_tokenizer_and_chat_template(written, variant):
    info = written(variant)
    vocab = info["vocab"]
    tok = transformers_tokenizer(info)
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.chat_template == vocab["chat_template"]
    assert tok.convert_tokens_to_ids(tok.eos_token) == vocab["eos"]
    assert tok.convert_tokens_to_ids(tok.bos_token) == vocab["bos"]
    assert (tok.encode("hi")[0] == vocab["bos"]) == vocab["add_bos"]
    # special and user-defined tokens stay whole
    whole = [t for t, kind in zip(vocab["tokens"], vocab["token_types"]) if kind in (3, 4)]
    for token in whole:
        if token not in ("<s>", "</s>"):  # sentencepiece's are not matched in text
            assert tok.encode(token, add_special_tokens=False) == [vocab["tokens"].index(token)]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "Be brief." in rendered and "Hi" in rendered


@pytest.mark.parametrize(
    "variant, weight_type, bound",
    [
        *[(variant, "Q8_0", 0.06) for variant in VARIANTS],
        *[(variant, "Q4_K", 0.5) for variant in VARIANTS],
        *[("llama-spm", t, b) for t, b in [("F16", 0.01), ("BF16", 0.03), ("Q4_0", 0.6)]],
        *[("llama-spm", t, b) for t, b in [("Q5_K", 0.3), ("Q6_K", 0.2)]],
    ],
)
def test_transformers_reads_the_quantized_values(written, variant, weight_type, bound):
    """transformers' dequantization of the file gives exactly the source model holding
    dequantize(quantize(w)) values; against the source model itself the logits move by what
    the type's error does to a random 2-layer model (relative L2; Q4_K about 0.35)."""
    info = written(variant, weight_type)
    reader = gguf.GGUFReader(info["gguf_path"])
    for t in reader.tensors:
        assert t.tensor_type == info["tensor_types"][t.name]
        assert (t.tensor_type == Q.F32) == (len(t.shape) == 1)
    got = logits(transformers_model(info))
    torch.testing.assert_close(got, logits(dequantized_model(info)), atol=1e-4, rtol=1e-4)
    exact = logits(info["model"])
    assert float((got - exact).norm() / exact.norm()) < bound


def test_q4_k_m_mixes_types_as_llama_quantize(written):
    info = written("qwen2", "Q4_K_M")  # tied: the embedding is the output, so Q6_K
    types = info["tensor_types"]
    assert types["token_embd.weight"] == Q.Q6_K
    # use_more_bits picks the last of two layers for attn_v and ffn_down
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == Q.Q4_K
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == Q.Q6_K
    assert types["blk.1.attn_q.weight"] == types["blk.1.ffn_up.weight"] == Q.Q4_K
    assert types["blk.1.attn_q.bias"] == Q.F32
    reader = gguf.GGUFReader(info["gguf_path"])
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    got = logits(transformers_model(info))
    torch.testing.assert_close(got, logits(dequantized_model(info)), atol=1e-4, rtol=1e-4)


def test_the_hf_folder_is_the_same_model_and_tokenizer(written):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = written("qwen3")
    hf = AutoModelForCausalLM.from_pretrained(info["hf_dir"], dtype=torch.float32).eval()
    torch.testing.assert_close(logits(hf), logits(info["model"]), atol=0, rtol=0)
    tok = AutoTokenizer.from_pretrained(info["hf_dir"])
    assert tok.chat_template == info["vocab"]["chat_template"]
    for text in TEXTS:
        assert tok.encode(text) == transformers_tokenizer(info).encode(text)


def test_the_seed_decides_the_weights(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", "qwen2", seed=0, save_hf=False)
    b = write_tiny_gguf(tmp_path / "b.gguf", "qwen2", seed=0, save_hf=False)
    c = write_tiny_gguf(tmp_path / "c.gguf", "qwen2", seed=1, save_hf=False)
    assert a["gguf_path"].read_bytes() == b["gguf_path"].read_bytes()
    assert a["gguf_path"].read_bytes() != c["gguf_path"].read_bytes()
