"""The LM head read from a GGUF's own Q8_0 blocks (kernels/q8_0, gguf_blocks, csrc/q8_0_gemv.c).

The kernel is checked on every instruction set this machine can run (AVX-512 with and
without VNNI, AVX2, plain C: each a build of its own) against the product it promises:
the same int16 activations and int8 weights multiplied exactly, in float64. Then the
blocks themselves (read from a GGUF as stored, equal to the loader's dequantized table),
the head's plan (the kernel taken where it timed faster, unused copies dropped), and the
embedded model's head: its logits as close to the exact path's as the fp16 copy's.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import bf16_matmul_supported, cpu_features
from kernels.gguf_blocks import head_blocks
from kernels.lm_head import onednn_available
from kernels.q8_0 import (
    BLOCK,
    Q8_0Weight,
    build_library,
    compiler,
    kernel,
    load_library,
)

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler to build the kernel")

# (flags, the instruction set the build must report, CPU flags it needs)
BUILDS = {
    "native": (("-march=native",), None, ()),
    "avx512bw": (("-march=native", "-mno-avx512vnni"), 2, ("avx512bw",)),
    "avx2": (("-march=native", "-mno-avx512f"), 1, ("avx2", "fma")),
    "plain": (("-march=x86-64",), 0, ()),
}


def _build(name: str, tmp_path_factory):
    flags, isa, needs = BUILDS[name]
    have = cpu_features().flags
    if not set(needs) <= have:
        pytest.skip(f"this CPU lacks {sorted(set(needs) - have)}")
    try:
        lib = load_library(build_library(flags, tmp_path_factory.mktemp(name)))
    except RuntimeError as exc:  # e.g. a compiler without these options (not x86)
        pytest.skip(f"cannot build {name}: {exc}")
    if isa is not None:
        assert lib.q8_0_isa() == isa
    return lib


def _int16_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization, in numpy: per 32-block, the largest |x| maps
    to 32767, rounded to nearest even."""
    n, h = x.shape
    blocks = x.double().numpy().reshape(n, h // BLOCK, BLOCK).astype(np.float32)
    largest = np.abs(blocks).max(-1)
    inv = np.where(largest > 0, np.float32(32767) / np.where(largest > 0, largest, 1), 0)
    q = np.rint(blocks * inv[..., None].astype(np.float32)).astype(np.int64)
    return q.reshape(n, h), (largest / np.float32(32767)).astype(np.float32)


def _promised(weight: Q8_0Weight, x: torch.Tensor) -> np.ndarray:
    """float64 [n, V]: the int16 activations times the int8 weights exactly, each block (or
    each half block, with a scale per 16) scaled by its weight and activation scales, less
    each block's minimum times the block's activation sum."""
    xq, xs = _int16_activations(x)
    v, h = weight.shape
    ng, sub = h // BLOCK, weight.subblocks
    q = weight.q.numpy().astype(np.int64).reshape(v, ng, sub, BLOCK // sub)
    xq = xq.reshape(-1, ng, sub, BLOCK // sub)
    dots = np.einsum("vgsk,ngsk->nvgs", q, xq).astype(np.float64)
    scales = weight.scales.numpy().astype(np.float64).reshape(v, ng, sub)
    xs = xs.astype(np.float64)
    out = np.einsum("nvgs,vgs,ng->nv", dots, scales, xs)
    if weight.mins is not None:
        sums = xq.sum(axis=(2, 3)).astype(np.float64) * xs  # [n, ng]
        out -= np.einsum("vg,ng->nv", weight.mins.numpy().astype(np.float64), sums)
    return out


def _weight(kind: str, vocab: int, hidden: int, generator) -> Q8_0Weight:
    """Q8_0 blocks (fp16 scales, packed so; "fp32_scales": scales no fp16 holds, packed as
    fp32), or the K-quants' kinds: a scale per 16 (Q6_K), minimums (Q4_K), both."""
    weight = Q8_0Weight.quantize(torch.randn(vocab, hidden, generator=generator) * 0.05)
    scales, mins = weight.scales, None
    if kind == "fp32_scales":
        scales = scales * 1.0001
    if kind in ("sub16", "both"):
        scales = torch.rand(vocab, hidden // BLOCK, 2, generator=generator) * 1e-3
    if kind in ("mins", "both"):
        mins = torch.rand(vocab, hidden // BLOCK, generator=generator) * 0.05
    return Q8_0Weight(weight.q, scales, mins)


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("vocab, hidden", [(4099, 96), (64, 640)])  # padded tiles, odd blocks
@pytest.mark.parametrize("kind", ["q8_0", "fp32_scales", "sub16", "mins", "both"])
def test_every_build_computes_the_promised_product(build, vocab, hidden, kind, tmp_path_factory):
    lib = _build(build, tmp_path_factory)
    generator = torch.Generator().manual_seed(vocab)
    weight = _weight(kind, vocab, hidden, generator)
    packed = weight.packed(lib)
    assert not packed.traceable  # another build's layout: its own ctypes path
    for n in (1, 2, 3, 5, 9):
        x = torch.randn(n, hidden, generator=generator)
        x[0, :BLOCK] = 0  # an all-zero block
        out = packed.product(x)
        assert out.shape == (n, vocab) and out.dtype == torch.float32
        assert torch.equal(packed.linear(x), out)
        promised = _promised(weight, x)
        # fp32 sums of exact integer dots: error of fp32 rounding only
        bound = 1e-5 * np.abs(promised).max() + 1e-6
        assert np.abs(out.double().numpy() - promised).max() <= bound, (build, n)
        # ... which is the exact product up to the activations' 16-bit rounding
        exact = F.linear(x.double(), weight.dequantized().double())
        largest = x.abs().double().view(n, -1, BLOCK).amax(-1, keepdim=True)
        per_value = largest.expand(n, hidden // BLOCK, BLOCK).reshape(n, hidden) * 2.0**-16
        slack = F.linear(per_value, weight.dequantized().abs().double()) + bound
        assert ((out.double() - exact).abs() <= slack).all()


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_build_quantizes_the_activations_as_promised(build, tmp_path_factory):
    """The activations' int16 values and scales exactly (vectorized or not): an identity
    weight hands back each value's x16 * xs with one rounding, as numpy computes it."""
    lib = _build(build, tmp_path_factory)
    generator = torch.Generator().manual_seed(11)
    h = 4 * BLOCK
    q = torch.eye(h, dtype=torch.int8).view(h, h // BLOCK, BLOCK)
    packed = Q8_0Weight(q, torch.ones(h, h // BLOCK)).packed(lib)
    for scale in (1e-6, 1.0, 1e5):
        x = torch.randn(3, h, generator=generator) * scale
        x[1, BLOCK : 2 * BLOCK] = 0  # a zero block
        x[2, :BLOCK] = -0.0
        # 32767 the largest: a step of exactly 1, so halves round to even (2.5 -> 2)
        x[2, BLOCK : 2 * BLOCK] = 0.0
        x[2, BLOCK : BLOCK + 7] = torch.tensor([32767.0, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5])
        xq, xs = _int16_activations(x)
        assert list(xq[2, BLOCK : BLOCK + 7]) == [32767, 0, 2, 2, 0, -2, -4]
        want = (xq.astype(np.float32) * np.repeat(xs, BLOCK, axis=1)).astype(np.float32)
        assert np.array_equal(packed.product(x).numpy(), want), scale
    # A NaN or an infinity: its row's outputs NaN, other rows' not; a block so small that
    # 32767 / its largest overflows: zeros (the rest of its row as without it).
    x = torch.randn(4, h, generator=generator)
    for row, bad in enumerate((float("nan"), float("inf"), float("-inf"))):
        x[row, BLOCK + 3] = bad
    without = x[3].clone()
    x[3, 2 * BLOCK : 3 * BLOCK] = torch.randn(BLOCK, generator=generator) * 1e-36
    without[2 * BLOCK : 3 * BLOCK] = 0
    out = packed.product(x)
    assert out[:3].isnan().all()
    assert torch.equal(out[3], packed.product(without[None])[0])


@pytest.mark.parametrize("build", list(BUILDS))
def test_fp16_scales_pack_as_fp16_and_compute_as_their_fp32_values(build, tmp_path_factory):
    """One scale a block, no minimums, every scale an fp16 value (a GGUF's Q8_0, Q5_0 and
    Q4_0 blocks; subnormal, zero and near-largest ones here): packed as fp16, with the very
    product of the same scales packed as fp32. Other scales and kinds stay fp32."""
    lib = _build(build, tmp_path_factory)
    generator = torch.Generator().manual_seed(5)
    weight = Q8_0Weight.quantize(torch.randn(40, 96, generator=generator) * 0.05)
    scales = weight.scales.clone()
    scales[0, 0], scales[1, 1], scales[2, 2], scales[3, 0] = 2.0**-20, 2.0**-24, 0.0, 60000.0
    packed = Q8_0Weight(weight.q, scales).packed(lib)
    assert packed.scales.dtype == torch.float16
    as_fp32 = dataclasses.replace(packed, scales=packed.scales.float())
    for n in (1, 2, 5):
        x = torch.randn(n, 96, generator=generator)
        assert torch.equal(packed.product(x), as_fp32.product(x))
    assert Q8_0Weight(weight.q, scales * 1.0001).packed(lib).scales.dtype == torch.float32
    for kind in ("sub16", "mins", "both"):
        assert _weight(kind, 40, 96, generator).packed(lib).scales.dtype == torch.float32


def test_a_bf16_input_and_a_zero_input(tmp_path_factory):
    weight = Q8_0Weight.quantize(torch.randn(48, 64) * 0.1)
    packed = weight.packed()
    assert torch.equal(packed.product(torch.zeros(2, 64)), torch.zeros(2, 48))
    poisoned = torch.randn(2, 64)
    poisoned[1, 40] = float("nan")  # as the exact path would, NaN in gives NaN out
    out = packed.product(poisoned)
    assert out[0].isfinite().all() and out[1].isnan().all()
    x = torch.randn(3, 64).to(torch.bfloat16)
    expected = F.linear(x.float(), weight.dequantized())
    assert (packed.product(x) - expected).abs().max() <= 1e-3 * expected.abs().max()
    with pytest.raises(ValueError, match="features"):
        packed.product(torch.randn(1, 32))


def test_quantize_and_dequantize_are_llama_cpp_q8_0():
    w = torch.tensor([[0.0] * 31 + [1.27] + [-0.5] * 32])
    blocks = Q8_0Weight.quantize(w)
    fp16 = torch.tensor([1.27 / 127, 0.5 / 127]).half().float()  # Q8_0 keeps fp16 scales
    assert torch.equal(blocks.scales[0], fp16)
    assert blocks.q[0, 0, 31] == 127 and blocks.q[0, 1, 0] == -127 and blocks.q[0, 0, 0] == 0
    assert (blocks.dequantized() - w).abs().max() <= blocks.scales.max() / 2
    with pytest.raises(ValueError, match="int8 \\[V, H / 32, 32\\]"):
        Q8_0Weight(torch.zeros(2, 40, dtype=torch.int8), torch.zeros(2, 1))


# ---- the blocks as a GGUF stores them --------------------------------------------------


def test_a_tied_q8_0_embedding_is_read_as_stored(tmp_path):
    from kernels.models import load_config, load_model_weights
    from tests.model.gguf_fixtures import write_tiny_gguf

    made = write_tiny_gguf(tmp_path / "tied.gguf", "qwen2", "Q8_0", save_hf=False)
    path = made["gguf_path"]
    config = load_config(str(path))
    blocks = head_blocks(path, config)
    table = load_model_weights(str(path), torch.float32)["embed_tokens.weight"]
    assert blocks is not None and torch.equal(blocks.dequantized(), table)
    assert not blocks.q.is_contiguous()  # read in place, in the file's own records
    x = torch.randn(3, blocks.shape[1])
    copied = Q8_0Weight(blocks.q.contiguous(), blocks.scales)
    assert torch.equal(blocks.packed().product(x), copied.packed().product(x))
    # where the blocks lie is found once, then read from the artifact folder
    record = next(path.parent.glob("*.kvactor")) / "tensor_locations.json"
    saved = json.loads(record.read_text())
    saved["where"]["token_embd.weight"][2:] = [1, 64]  # a record we can tell apart
    record.write_text(json.dumps(saved))
    assert head_blocks(path, config).shape == (1, 64)
    saved["stamp"] = "stale"
    record.write_text(json.dumps(saved))
    assert head_blocks(path, config).shape == blocks.shape


@pytest.mark.parametrize(
    "arch, weight_type", [("qwen2", "F32"), ("qwen2", "Q4_K_M"), ("qwen3", "Q8_0")]
)
def test_other_heads_have_no_q8_0_blocks(arch, weight_type, tmp_path):
    """An F32 or Q6_K embedding, or an untied head (qwen3 here), is not read so."""
    from kernels.models import load_config
    from tests.model.gguf_fixtures import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", arch, weight_type, save_hf=False)["gguf_path"]
    assert head_blocks(path, load_config(str(path))) is None


# ---- the head's plan ---------------------------------------------------------------------


def _vectorized(monkeypatch, answer: bool) -> None:
    import kernels.lm_head as lm_head_module

    monkeypatch.setattr(lm_head_module, "q8_0_vectorized", lambda: answer)


def test_the_blocks_take_the_fp16_copys_calls_of_an_fp32_head(monkeypatch):
    """An fp32 model (the default where the CPU has no native bf16): the blocks narrow, and
    the oneDNN copy keeps the exact (not fp16-rounded) weight, so a row's logits keep one
    precision whatever its batch."""
    from kernels.lm_head import LmHead, fp16_plan

    blocks = Q8_0Weight.quantize(torch.randn(4099, 64) * 0.05)
    exact = blocks.dequantized()
    _vectorized(monkeypatch, True)
    head = LmHead(exact, backend=fp16_plan(), q8_0=blocks)
    assert head.backend_for(16) == "q8_0" and head._fp16 is None
    if head._packed is not None:  # oneDNN runs here
        x = torch.randn(32, 64)
        want = F.linear(x, exact)
        assert (head(x) - want).abs().max() <= 1e-5 * want.abs().max()
    # a plain C build (or none): the plan as it was, and the blocks let go
    _vectorized(monkeypatch, False)
    head = LmHead(exact, backend=fp16_plan(), q8_0=blocks)
    assert head._q8_0 is None and head._fp16 is not None and head.backend_for(1) == "fp16"
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        LmHead(exact, backend={1: "q8_0"})
    with pytest.raises(ValueError, match="Q8_0 blocks of"):
        LmHead(exact, backend=fp16_plan(), q8_0=Q8_0Weight.quantize(torch.zeros(8, 64)))


@pytest.mark.skipif(
    not (bf16_matmul_supported() and onednn_available()),
    reason="a bf16 head's wide calls need oneDNN's bf16 product",
)
def test_the_blocks_take_the_fp16_copys_calls_of_a_bf16_head(monkeypatch):
    from kernels.lm_head import LmHead, narrow_fp16_plan

    weight = (torch.randn(4099, 64) * 0.05).to(torch.bfloat16)
    blocks = Q8_0Weight.quantize(weight.float())
    _vectorized(monkeypatch, True)
    head = LmHead(weight, backend=narrow_fp16_plan(), q8_0=blocks)
    # every call the fp16 copy served (up to 5 rows) takes the blocks; wider ones oneDNN
    assert [head.backend_for(n) for n in (1, 2, 3, 4, 5, 6, 32)] == ["q8_0"] * 5 + ["onednn"] * 2
    assert head._fp16 is None and head._q8_0 is not None  # no fp16 copy is made
    x = torch.randn(2, 64)
    assert (head(x) - F.linear(x, blocks.dequantized())).abs().max() < 0.02
    _vectorized(monkeypatch, False)
    head = LmHead(weight, backend=narrow_fp16_plan(), q8_0=blocks)
    assert head._q8_0 is None and head._fp16 is not None
    assert [head.backend_for(n) for n in (1, 4, 8)] == ["fp16", "fp16", "onednn"]


def test_the_kernel_builds_here():
    assert kernel() is not None


@pytest.mark.model
def test_the_embedded_heads_blocks_are_its_weights_and_closer_than_the_fp16_copy():
    """Gemma 3 270M's head is its Q8_0 embedding: the blocks equal the exact path's weight,
    and a bf16 model's logits through them are as close to the exact path's as through
    the fp16 copy of its bf16 weights (the default layout's), or closer."""
    from kernels.gguf_loader import default_model_path
    from kernels.lm_head import LmHead
    from kernels.models import load_model

    config, model = load_model(None, torch.float32)
    blocks = head_blocks(default_model_path(), config)
    assert blocks is not None and torch.equal(blocks.dequantized(), model.lm_head_weight)
    assert model.gguf_path == str(default_model_path())
    hidden = torch.randn(4, config.hidden, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)  # as a bf16 model's last norm hands them over
    exact = F.linear(hidden.double(), model.lm_head_weight.double())
    bf16_weight = model.lm_head_weight.to(torch.bfloat16)
    via_blocks = LmHead(bf16_weight, backend={1: "q8_0"}, q8_0=blocks)(hidden)
    via_fp16 = LmHead(bf16_weight, backend={1: "fp16"})(hidden)
    err_blocks = (via_blocks.double() - exact).abs().max().item()
    err_fp16 = (via_fp16.double() - exact).abs().max().item()
    # (both hand back bf16 logits, as a bf16 model's head does: that rounding dominates)
    assert err_blocks <= err_fp16 and err_blocks < 2.0**-7 * exact.abs().max().item()


@pytest.mark.parametrize("kind", ["q8_0", "fp32_scales", "sub16", "mins", "both"])
def test_the_operator_computes_what_the_ctypes_path_does(kind, monkeypatch):
    """`Q8_0Packed.linear` as `torch.ops.kvactor.q8_0_linear` (one op, no ctypes) and
    through ctypes give the same tensor, for every kind of block: padding rows dropped, the
    bias added in fp32, the rows' dtype; bad operands are refused."""
    from kernels import q8_0

    if kernel() is None or not q8_0.load_operator():
        pytest.skip(f"no operator here: {q8_0.operator_status()}")
    generator = torch.Generator().manual_seed(3)
    weight = _weight(kind, 40, 96, generator)  # 40 rows: 48 packed
    packed = weight.packed()
    assert packed.traceable and tuple(packed.q.shape) == (48, 96)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 96, generator=generator).to(dtype)
        bias = torch.randn(40, generator=generator).to(dtype)
        for b in (None, bias):
            got = packed.linear(x, b)
            with monkeypatch.context() as patch:
                patch.setattr(q8_0, "_operator_loaded", False)
                assert not packed.traceable
                want = packed.linear(x, b)
            assert got.dtype == dtype and got.shape == (3, 40)
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="rows of 64 features for blocks of \\[48, 96\\]"):
        packed.linear(torch.randn(1, 64))
    n = packed.subblocks
    with pytest.raises(ValueError, match="scales must be a contiguous CPU tensor"):
        torch.ops.kvactor.q8_0_linear(
            torch.randn(1, 96), packed.q, packed.scales.double(), packed.mins, None, 40, n
        )
    with pytest.raises(ValueError, match="scales must be a contiguous CPU tensor"):
        torch.ops.kvactor.q8_0_linear(  # fp16 scales: one a block and no minimums only
            torch.randn(1, 96), packed.q, packed.scales.half(), packed.mins, None, 40, 2
        )
    with pytest.raises(ValueError, match="5 minimums for 144 blocks"):
        torch.ops.kvactor.q8_0_linear(  # (fp16 scales are for blocks without minimums)
            torch.randn(1, 96), packed.q, packed.scales.float(), torch.zeros(5), None, 40, n
        )
    with pytest.raises(ValueError, match="the bias must be a CPU vector of 40"):
        packed.linear(torch.randn(1, 96), torch.zeros(1))


def test_without_a_cxx_compiler_the_blocks_keep_the_ctypes_path(monkeypatch):
    from kernels import q8_0

    if kernel() is None:
        pytest.skip("no kernel here")
    monkeypatch.setattr(q8_0, "_operator_loaded", False)
    monkeypatch.setattr(q8_0, "_operator_status", "not built yet")
    monkeypatch.setattr(q8_0, "cxx_compiler", lambda: None)
    assert not q8_0.load_operator()
    assert q8_0.operator_status().startswith("not built: no C++ compiler (set CXX")
    weight = Q8_0Weight.quantize(torch.randn(32, 64) * 0.1)
    packed = weight.packed()
    x = torch.randn(2, 64)
    assert not packed.traceable and torch.equal(packed.linear(x), packed.product(x))
