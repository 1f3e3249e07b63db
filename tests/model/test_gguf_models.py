"""GGUF files of the Llama family (llama, qwen2, qwen3), as llama.cpp writes them, loaded by
kvactor: config, weights in every weight type people use (exact and kept quantized),
tokenizer, and the clear errors for what is not supported.

The files are tiny random-weight models written by `gguf_fixtures.write_tiny_gguf`; the
reference is HF transformers running a copy of the source model that holds exactly the
values the file holds (`dequantized_model`), so "exact" means equal to transformers on
the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.config import RopeSpec, UnsupportedModelError
from kernels.cpu import bf16_matmul_supported
from kernels.gguf_archs import llama3_rope
from kernels.gguf_loader import load_gguf_config, read_gguf_config
from kernels.layers import rope_inv_freq
from kernels.linear import choose_linear_backend
from kernels.models import (
    PLAN_KINDS,
    load_config,
    load_for,
    load_model,
    load_quantized_model,
    resolve_quantization,
)
from kernels.quant import QuantizedLinear
from kernels.tokenizer_loader import load_tokenizer
from tests.model.gguf_fixtures import dequantized_model, write_foreign_gguf, write_tiny_gguf
from tests.model.model_fixtures import GreedyRunner, make_executor

pytestmark = pytest.mark.model

PROMPTS = [[5, 17, 33, 60, 81, 99, 120, 7, 250, 301, 12], [9, 44, 200, 13]]
NEW_TOKENS = 32

# (arch, vocabulary kind) x weight type: every type on Llama (the permuted q/k), the
# others on the remaining families.
CASES = [
    *[("llama", "bpe", t) for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K")],
    *[("llama", "bpe", t) for t in ("Q6_K", "Q4_K_M")],
    ("llama", "spm", "F32"),
    ("llama", "spm", "Q4_K"),
    ("qwen2", "bpe", "F32"),
    ("qwen2", "bpe", "Q8_0"),
    ("qwen2", "bpe", "Q4_0"),
    ("qwen2", "bpe", "Q5_K"),
    ("qwen3", "bpe", "F32"),
    ("qwen3", "bpe", "BF16"),
    ("qwen3", "bpe", "Q6_K"),
    ("qwen3", "bpe", "Q4_K_M"),
]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Written on first use: (arch, tokenizer, type) -> write_tiny_gguf's info."""
    root = tmp_path_factory.mktemp("ggufs")
    made: dict[tuple[str, str, str], dict] = {}

    def get(arch: str, tok: str, weight_type: str) -> dict:
        key = (arch, tok, weight_type)
        if key not in made:
            path = root / f"{arch}-{tok}-{weight_type}.gguf"
            made[key] = write_tiny_gguf(path, arch, weight_type, tokenizer=tok, save_hf=False)
        return made[key]

    return get


def _run(config, model, lm_head=None) -> tuple[torch.Tensor, list[list[int]]]:
    executor, slots = make_executor(config, model, 4, 64, lm_head=lm_head)
    runner = GreedyRunner(executor, slots)
    return runner.prefill_logits(PROMPTS), runner.generate(PROMPTS, NEW_TOKENS)


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = model(ids).logits[0, -1]
        out = []
        for _ in range(n):
            logits = model(ids).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return first, out


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return float(np.mean([x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]))


@pytest.mark.parametrize(("arch", "tok", "weight_type"), CASES)
def test_exact_path_equals_transformers_on_the_files_weights(ggufs, arch, tok, weight_type):
    info = ggufs(arch, tok, weight_type)
    config, model = load_model(info["gguf_path"], torch.float32)
    logits, outputs = _run(config, model)
    reference = dequantized_model(info)
    for i, prompt in enumerate(PROMPTS):
        want_logits, want = _hf_greedy(reference, prompt, NEW_TOKENS)
        torch.testing.assert_close(logits[i], want_logits, atol=1e-4, rtol=1e-4)
        assert outputs[i] == want


def test_config_from_each_family(ggufs):
    llama = load_gguf_config(ggufs("llama", "bpe", "F32")["gguf_path"])
    assert (llama.arch, llama.num_layers, llama.hidden, llama.num_heads) == ("llama", 2, 256, 4)
    assert (llama.num_kv_heads, llama.head_dim, llama.intermediate) == (2, 64, 512)
    assert not llama.tie_embeddings and not llama.attention_bias and not llama.qk_norm
    assert llama.rope.theta == 500000.0 and llama.hidden_act == "silu"
    qwen2 = load_gguf_config(ggufs("qwen2", "bpe", "F32")["gguf_path"])
    assert qwen2.tie_embeddings and qwen2.attention_bias and not qwen2.qk_norm
    qwen3_info = ggufs("qwen3", "bpe", "F32")
    qwen3 = load_gguf_config(qwen3_info["gguf_path"])
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.attention_bias
    # end of generation: the eos id, and ChatML's turn end and <|endoftext|> (control tokens)
    vocab = qwen3_info["vocab"]
    tokens = vocab["tokens"]
    assert set(qwen3.eos_ids) == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert qwen3.extra["weight_types"] == {"F32": sum(_2d_sizes(qwen3_info))}


def _2d_sizes(info) -> list[int]:
    return [p.numel() for n, p in info["model"].named_parameters() if p.dim() == 2]


@pytest.mark.parametrize(("arch", "tok"), [("qwen2", "bpe"), ("llama", "bpe"), ("llama", "spm")])
def test_tokenizer_from_the_gguf_equals_transformers(ggufs, arch, tok):
    from transformers import AutoTokenizer

    info = ggufs(arch, tok, "F32")
    ours = load_tokenizer(info["gguf_path"])
    theirs = AutoTokenizer.from_pretrained(str(info["folder"]), gguf_file=info["gguf_file"])
    texts = ["Hello world", "  two  spaces\nand a newline", "café, naïve 3.14", "the end."]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        if not text.startswith(" "):  # sentencepiece drops a text's leading space
            assert ours.decode(ids) == text
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = ours.render_chat(chat)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    eos_text = {"qwen2": "<|im_end|>", "llama": "<|eot_id|>" if tok == "bpe" else "</s>"}[arch]
    assert ours.tokenizer.token_to_id(eos_text) in ours.eos_ids


@pytest.mark.parametrize(("arch", "weight_type"), [("llama", "Q4_K"), ("qwen2", "Q4_0")])
def test_four_bit_blocks_stay_int4_without_loss(ggufs, arch, weight_type):
    """Kept as stored with fp32 scales, Q4_0 / Q4_K weights are exactly the file's: the
    codes carry over and the affine map is rewritten, so logits equal the exact path. The
    embedding table too stays int4 (and is the head, when tied)."""
    from kernels.quant import Int4Embedding

    info = ggufs(arch, "bpe", weight_type)
    config, model = load_model(info["gguf_path"], torch.float32)
    exact, exact_out = _run(config, model)
    activations = {k: torch.float32 for k in PLAN_KINDS["gguf"]}
    config, quantized, head = load_quantized_model(info["gguf_path"], torch.float32, activations)
    linears = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * config.num_layers and {m.kind for m in linears} == {"int4"}
    assert isinstance(quantized.embed_tokens, Int4Embedding)
    logits, outputs = _run(config, quantized, head)
    torch.testing.assert_close(logits, exact, atol=1e-4, rtol=1e-4)
    assert outputs == exact_out
    # the head's float weight was never kept: only its int4 copy is held
    assert head.plan == {1: "int4"} and head.available_backends() == []
    assert quantized.lm_head_weight.untyped_storage().nbytes() <= 4


# Measured bounds on these random models (which magnify weight error several times over
# a trained model's): int8 in place of 5-8-bit blocks, bf16 scales for int4.
AS_STORED_MAX_LOGIT_ERROR = 1.0


@pytest.mark.parametrize(
    ("arch", "weight_type", "activations"),
    [
        ("llama", "Q8_0", torch.float32),
        ("qwen2", "Q5_K", torch.float32),
        ("qwen3", "Q6_K", torch.bfloat16),
        ("qwen3", "Q4_K_M", torch.float32),
        ("llama", "Q4_K", torch.bfloat16),
    ],
)
def test_kept_as_stored_stays_close_to_exact(ggufs, arch, weight_type, activations):
    info = ggufs(arch, "bpe", weight_type)
    path = info["gguf_path"]
    kind, why = resolve_quantization("auto", path, load_config(path))
    assert kind == "gguf" and "stays quantized" in why
    config, model = load_model(path, torch.float32)
    exact, _ = _run(config, model)
    plan = {k: activations for k in PLAN_KINDS[kind]}
    config, quantized, head = load_quantized_model(path, torch.float32, plan)
    logits, _ = _run(config, quantized, head)
    assert float((logits - exact).abs().max()) < AS_STORED_MAX_LOGIT_ERROR
    # each fused linear is int4 exactly when all its parts are stored in 4-bit blocks
    types = info["tensor_types"]
    for layer in range(config.num_layers):
        block = quantized.layers[layer]
        for module, parts in (
            (block.self_attn.qkv_proj, ("attn_q", "attn_k", "attn_v")),
            (block.mlp.gate_up_proj, ("ffn_gate", "ffn_up")),
            (block.mlp.down_proj, ("ffn_down",)),
        ):
            four_bit = all(types[f"blk.{layer}.{p}.weight"].name in ("Q4_0", "Q4_K") for p in parts)
            assert module.kind == ("int4" if four_bit else "int8")


def test_quantized_model_is_smaller_than_the_exact_one(ggufs):
    info = ggufs("llama", "bpe", "Q4_K")
    config, exact = load_model(info["gguf_path"], torch.float32)
    plan = {k: torch.bfloat16 for k in PLAN_KINDS["gguf"]}
    _, quantized, _ = load_quantized_model(info["gguf_path"], torch.float32, plan)

    def linear_bytes(model) -> int:
        total = 0
        for m in model.layers.modules():
            if isinstance(m, QuantizedLinear):
                total += m.quantized.nbytes
            elif isinstance(m, torch.nn.Linear):
                total += m.weight.numel() * m.weight.element_size()
        return total

    params = sum(m.weight.numel() for m in exact.layers.modules() if type(m) is torch.nn.Linear)
    # int4: half a byte a weight, plus a bf16 scale and zero per 32 weights
    assert linear_bytes(quantized) == pytest.approx(params * (0.5 + 4 / 32), rel=0.01)
    assert linear_bytes(exact) == 4 * params


def test_resolve_quantization_rules(ggufs):
    f32 = ggufs("qwen2", "bpe", "F32")["gguf_path"]
    q4 = ggufs("qwen2", "bpe", "Q4_0")["gguf_path"]
    assert resolve_quantization("auto", f32, load_config(f32))[0] == "none"
    assert resolve_quantization("auto", q4, load_config(q4))[0] == "gguf"
    assert resolve_quantization("auto", q4, load_config(q4), device="cuda")[0] == "none"
    assert resolve_quantization("int8", f32, load_config(f32)) == ("int8", "set in the config")
    embedded = load_config(None)
    assert resolve_quantization("auto", None, embedded) == (
        "none",
        "auto: the embedded model runs exact",
    )


def test_an_unsupported_architecture_is_refused_naming_it(tmp_path):
    path = write_foreign_gguf(tmp_path / "phi.gguf")
    with pytest.raises(UnsupportedModelError, match="'phi3' is not supported.*llama, qwen2"):
        read_gguf_config(path)


def _rewritten(source_path, path, drop_key=None, extra_keys=(), extra_tensors=()):
    """A copy of a GGUF without the metadata key `drop_key`, with `extra_keys` ((key,
    value) pairs, integers) and `extra_tensors` ((name, array) pairs) added."""
    import gguf

    source = gguf.GGUFReader(str(source_path))
    writer = gguf.GGUFWriter(path, source.fields["general.architecture"].contents())
    for field in source.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")) or field.name == drop_key:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for key, value in extra_keys:
        writer.add_uint32(key, value)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    for name, array in extra_tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unreadable_or_malformed_gguf_is_refused_at_start(ggufs, tmp_path):
    """Each fails the config read, before any weight, with a message naming what is wrong."""
    source = ggufs("qwen2", "bpe", "F32")["gguf_path"]
    odd_type = _rewritten(
        source, tmp_path / "i32.gguf", extra_tensors=[("blk.0.extra", np.zeros(4, np.int32))]
    )
    with pytest.raises(UnsupportedModelError, match="I32 cannot be read"):
        read_gguf_config(odd_type)
    no_layers = _rewritten(source, tmp_path / "no-layers.gguf", drop_key="qwen2.block_count")
    with pytest.raises(UnsupportedModelError, match="lacks qwen2.block_count"):
        read_gguf_config(no_layers)
    experts = _rewritten(source, tmp_path / "moe.gguf", extra_keys=[("qwen2.expert_count", 8)])
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        read_gguf_config(experts)
    stray = _rewritten(
        source,
        tmp_path / "stray.gguf",
        extra_tensors=[("blk.0.ffn_gate_inp.weight", np.zeros((4, 256), np.float32))],
    )
    with pytest.raises(UnsupportedModelError, match="'blk.0.ffn_gate_inp.weight' is not part"):
        read_gguf_config(stray)


def test_q_and_k_are_unpermuted_whole_when_read_in_row_blocks(ggufs, monkeypatch):
    """A q/k tensor taller than one row block (Llama's q has 8192+ rows in large models)
    is put back in order before it is cut into blocks."""
    import kernels.gguf_loader as gguf_loader

    path = ggufs("llama", "bpe", "Q8_0")["gguf_path"]
    whole = gguf_loader.convert_gguf_weights(path)  # read from the file, never a cache
    monkeypatch.setattr(gguf_loader, "_CHUNK_ROWS", 48)  # q: 256 rows, k: 128 rows
    blocked = gguf_loader.convert_gguf_weights(path)
    assert whole.keys() == blocked.keys()
    for name, tensor in whole.items():
        assert torch.equal(tensor, blocked[name]), name


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_four_bit_blocks_map_onto_the_int4_layout_exactly(tmp_path, qtype):
    import gguf

    from kernels.gguf_int4 import int4_part
    from kernels.quant import dequantize_groups
    from tests.model.gguf_fixtures import quantize_tensor

    weights = np.random.default_rng(0).standard_normal((48, 512)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    path = tmp_path / f"{qtype}.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", quantize_tensor(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    codes, scales_zeros = int4_part(tensor, torch.float32)
    want = gguf.quants.dequantize(tensor.data, kind).reshape(48, 512)
    got = dequantize_groups(codes, scales_zeros).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_llama3_rope_is_read_from_the_rope_freqs_tensor():
    spec = RopeSpec(theta=500000.0, kind="llama3", factor=32.0)
    base = rope_inv_freq(RopeSpec(theta=500000.0), 64)
    divisors = (base / rope_inv_freq(spec, 64)).numpy()  # what llama.cpp's converter stores
    assert llama3_rope(divisors, 500000.0, 64) == spec
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        llama3_rope(np.linspace(1.0, 8.0, 32, dtype=np.float32), 500000.0, 64)


def test_a_synthetic_q4_k_m_gguf_loads_as_stored_and_benches(tmp_path, capsys):
    """`bench synthetic-gguf` writes a real model's layout (here its tiny shape) in
    llama.cpp's Q4_K_M mix; auto keeps it as stored and `bench model` reports its size."""
    from actors.bench import model as bench_model
    from actors.bench.synthetic_gguf import SHAPES, write

    path = tmp_path / "synthetic.gguf"
    write(str(path), SHAPES["tiny"])
    config, model, head, mode, why = load_for(path, torch.bfloat16, "auto")
    assert mode == "gguf" and "Q4_K" in why and "Q6_K" in why
    # Q4_K_M: layer 1 has Q6_K attn_v and ffn_down (use_more_bits), layer 0 only Q4_K
    kinds = [
        (layer.self_attn.qkv_proj.kind, layer.mlp.down_proj.kind, layer.mlp.gate_up_proj.kind)
        for layer in model.layers
    ]
    assert kinds == [("int4", "int4", "int4"), ("int8", "int8", "int4")]
    assert head.plan  # the Q6_K output is an int8 head
    bench_model.main(
        ["--model", str(path), "--quantization", "auto", "--dtype", "bf16", "--no-hf"]
        + ["--batches", "1", "--context", "16", "--prefill-len", "16", "--repeats", "1"]
    )
    out = capsys.readouterr().out
    assert "quantization gguf" in out and "weights in memory" in out and "decode batch  1" in out
    assert "memory bandwidth: read" in out and "weight-read floor" in out
    # The step's bytes: Q4_K/Q6_K weights held at 4-8 bits (plus scales), not at 16 or 32.
    c = config
    weights = c.vocab * c.hidden + c.num_layers * (
        c.hidden * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
        + 3 * c.hidden * c.intermediate
    )
    assert 0.5 * weights < bench_model.step_read_bytes(model, head) < 1.3 * weights


def test_bench_quality_builds_each_mode(ggufs):
    """`bench quality --modes fp32,gguf,int8`: each mode's executor as the runner loads it."""
    from actors.bench.quality import build

    path = ggufs("llama", "bpe", "Q4_K")["gguf_path"]
    kinds = {}
    for mode in ("fp32", "gguf", "int8"):
        executor = build(mode, path, 1, 32)
        kinds[mode] = {m.kind for m in executor.model.modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {"fp32": set(), "gguf": {"int4"}, "int8": {"int8"}}
    assert build("fp32", path, 1, 32).linear == "aten"  # the exact path
    if bf16_matmul_supported():  # bf16: the layout the runner's auto picks here
        want = choose_linear_backend("auto", torch.device("cpu"), torch.bfloat16)[0]
        assert build("bf16", path, 1, 32).linear == want


@pytest.mark.parametrize(
    ("arch", "weight_type", "within"),
    [("qwen2", "Q4_0", 0.001), ("llama", "Q8_0", 0.001), ("qwen3", "Q4_K_M", 0.06)],
)
def test_the_memory_plan_estimates_a_gguf_kept_as_stored(ggufs, arch, weight_type, within):
    """The plan's estimate (made before loading) against the bytes the loaded model holds:
    exact for one type, a few percent under for a mix (a stacked projection with one
    part in 6-bit blocks is int8 whole; the estimate splits by parameter share)."""
    from kernels.memory_plan import measured_weight_bytes, weight_bytes

    path = ggufs(arch, "bpe", weight_type)["gguf_path"]
    plan = {k: torch.bfloat16 for k in PLAN_KINDS["gguf"]}
    config, model, head = load_quantized_model(path, torch.bfloat16, plan)
    estimate = weight_bytes(config, 2, "gguf", activation_bytes=2).total
    assert estimate == pytest.approx(measured_weight_bytes(model, head), rel=within)
