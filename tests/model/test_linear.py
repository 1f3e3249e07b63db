"""kernels/linear.py: stacked projections, oneDNN-packed, fp16 and onednn+fp16 linears against
F.linear, and the choice of layout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import bf16_matmul_supported
from kernels.linear import (
    FP16_MAX,
    NARROW_ROWS,
    Fp16Linear,
    NarrowFp16Linear,
    OneDnnLinear,
    choose_linear_backend,
    fits_fp16,
    fp16_linear_works,
    onednn_linear_works,
    pack_linears,
    stack_projections,
)
from kernels.quant import QuantizedLinear, quantize_linears

needs_onednn = pytest.mark.skipif(
    not onednn_linear_works(torch.float32), reason="oneDNN does not run fp32 linears here"
)
needs_fp16 = pytest.mark.skipif(
    not fp16_linear_works(), reason="fbgemm's fp16 linear does not run here (not x86)"
)


def test_stack_projections_stacks_in_order_and_passes_the_rest_through():
    t = {n: torch.full((2, 3), float(i)) for i, n in enumerate(["q", "k", "v", "g", "u"])}
    weights = {
        "layers.0.self_attn.q_proj.weight": t["q"],
        "layers.0.self_attn.k_proj.weight": t["k"],
        "layers.0.self_attn.v_proj.weight": t["v"],
        "layers.0.self_attn.q_proj.bias": torch.tensor([1.0, 2.0]),
        "layers.0.self_attn.k_proj.bias": torch.tensor([3.0]),
        "layers.0.self_attn.v_proj.bias": torch.tensor([4.0]),
        "layers.0.mlp.gate_proj.weight": t["g"],
        "layers.0.mlp.up_proj.weight": t["u"],
        "layers.0.mlp.down_proj.weight": torch.ones(3, 2),
        "norm.weight": torch.ones(3),
    }
    out = stack_projections(weights)
    assert sorted(out) == [
        "layers.0.mlp.down_proj.weight",
        "layers.0.mlp.gate_up_proj.weight",
        "layers.0.self_attn.qkv_proj.bias",
        "layers.0.self_attn.qkv_proj.weight",
        "norm.weight",
    ]
    assert torch.equal(
        out["layers.0.self_attn.qkv_proj.weight"][:, 0],
        torch.tensor([0.0] * 2 + [1.0] * 2 + [2.0] * 2),
    )
    assert out["layers.0.self_attn.qkv_proj.bias"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert out["layers.0.mlp.gate_up_proj.weight"][:, 0].tolist() == [3.0, 3.0, 4.0, 4.0]
    assert "layers.0.self_attn.q_proj.weight" in weights  # the input is not modified


def test_stack_projections_names_a_missing_part():
    weights = {
        "layers.0.self_attn.q_proj.weight": torch.ones(2, 2),
        "layers.0.self_attn.k_proj.weight": torch.ones(1, 2),
    }
    with pytest.raises(ValueError, match="v_proj.weight"):
        stack_projections(weights)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(dtype, bias):
    if dtype == torch.bfloat16 and not (bf16_matmul_supported() and onednn_linear_works(dtype)):
        pytest.skip("oneDNN does not run bf16 on this CPU")
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(640, 1536, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 640, generator=gen) / 25)
        if bias:
            linear.bias.copy_(torch.randn(1536, generator=gen))
    linear = linear.to(dtype)
    packed = OneDnnLinear(linear)
    assert torch.equal(packed.weight, linear.weight)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for shape in [(1, 640), (7, 640), (2, 3, 640), (0, 640)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        want = F.linear(x, linear.weight, linear.bias)
        got = packed(x)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), **tol)
    # A strided view (a slice of a wider activation) multiplies the same.
    wide = torch.randn(4, 1280, generator=gen).to(dtype)
    torch.testing.assert_close(
        packed(wide[:, :640]).float(),
        F.linear(wide[:, :640], linear.weight, linear.bias).float(),
        **tol,
    )


@needs_onednn
def test_packing_replaces_plain_linears_only_and_survives_deepcopy_and_quantization():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False)))
    model[2].add_module("1", QuantizedLinear(nn.Linear(4, 4)))
    x = torch.randn(5, 16)
    want = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], OneDnnLinear) and isinstance(model[2][0], OneDnnLinear)
    assert isinstance(model[2][1], QuantizedLinear)
    assert pack_linears(model) == 0  # nothing plain is left
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    clone = copy.deepcopy(model)
    assert clone[0].packed is not model[0].packed
    torch.testing.assert_close(clone(x), want, rtol=1e-5, atol=1e-5)
    assert quantize_linears(clone) == 2  # packed linears quantize from their plain weight
    assert isinstance(clone[0], QuantizedLinear)
    assert (clone(x) - want).norm() / want.norm() < 2e-2


def test_choose_linear_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_linear_backend("aten", cpu, torch.float32)[0] == "aten"
    assert choose_linear_backend("aten", cuda, torch.bfloat16)[0] == "aten"
    if onednn_linear_works(torch.float32):
        assert choose_linear_backend("onednn", cpu, torch.float32)[0] == "onednn"
    with pytest.raises(ValueError, match="CPU path"):
        choose_linear_backend("onednn", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="CPU path"):
        choose_linear_backend("fp16", cuda, torch.float32)
    with pytest.raises(ValueError, match="need an fp32 model"):
        choose_linear_backend("fp16", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="linear backend must be auto or one of"):
        choose_linear_backend("mkl", cpu, torch.float32)


def test_auto_layout_fp16_for_fp32_models_onednn_for_bf16_on_native_bf16_cpus():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_linear_backend("auto", cuda, torch.float32)[0] == "aten"
    assert choose_linear_backend("auto", cuda, torch.bfloat16)[0] == "aten"
    assert choose_linear_backend("auto", cpu, torch.float16)[0] == "aten"
    # bf16: oneDNN-packed where the CPU multiplies bf16 natively (and oneDNN runs it)
    assert choose_linear_backend("auto", cpu, torch.bfloat16, native_bf16=False)[0] == "aten"
    packed = "aten"
    if onednn_linear_works(torch.bfloat16):
        packed = "onednn+fp16" if fp16_linear_works() else "onednn"
    assert choose_linear_backend("auto", cpu, torch.bfloat16, native_bf16=True)[0] == packed
    if packed == "onednn+fp16":  # a weight fp16 cannot hold: the bf16 copy alone
        huge = [torch.tensor([[1.0, 1e6]], dtype=torch.bfloat16)]
        assert choose_linear_backend("auto", cpu, torch.bfloat16, huge, native_bf16=True) == (
            "onednn",
            "auto: bf16 model, a weight is beyond fp16's range",
        )
    with pytest.raises(ValueError, match="need a bf16 model"):
        choose_linear_backend("onednn+fp16", cpu, torch.float32)
    backend, why = choose_linear_backend("auto", cpu, torch.float32)
    assert backend == ("fp16" if fp16_linear_works() else "aten"), why
    assert why.startswith("auto:")
    # Weights fp16 cannot hold keep the exact layout.
    huge = [torch.ones(2, 2), torch.tensor([[1.0, -2 * FP16_MAX]])]
    assert choose_linear_backend("auto", cpu, torch.float32, huge) == (
        "aten",
        "auto: a weight is beyond fp16's range",
    )
    assert fits_fp16([torch.ones(3), torch.tensor([FP16_MAX, -FP16_MAX]), torch.empty(0)])
    assert not fits_fp16([torch.tensor([1.0, float("nan")])])


@needs_fp16
@pytest.mark.parametrize("bias", [False, True])
def test_fp16_linear_is_the_product_of_the_fp16_rounded_weight_in_fp32(bias):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(640, 1536, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 640, generator=gen) / 25)
        if bias:
            linear.bias.copy_(torch.randn(1536, generator=gen))
    packed = Fp16Linear(linear)
    rounded = linear.weight.detach().half().float()
    assert torch.equal(packed.weight, rounded)  # stored exactly as fp16 holds it
    assert packed.weight_bytes == 2 * linear.weight.numel()
    for shape in [(1, 640), (7, 640), (33, 640), (2, 3, 640), (0, 640)]:
        x = torch.randn(*shape, generator=gen)
        got = packed(x)
        assert got.shape == (*shape[:-1], 1536) and got.dtype == torch.float32
        # fp32 accumulation of the rounded weight: summation order apart, the same numbers
        torch.testing.assert_close(got, F.linear(x, rounded, linear.bias), rtol=1e-5, atol=1e-5)
        # and within fp16's rounding of the exact product
        want = F.linear(x, linear.weight, linear.bias).detach()
        scale = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * scale)
    wide = torch.randn(4, 1280, generator=gen)
    torch.testing.assert_close(
        packed(wide[:, :640]), F.linear(wide[:, :640], rounded, linear.bias), rtol=1e-5, atol=1e-5
    )


@needs_fp16
def test_fp16_linear_refuses_what_fp16_cannot_hold_and_other_dtypes():
    linear = nn.Linear(4, 2)
    with torch.no_grad():
        linear.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match="beyond fp16's range"):
        Fp16Linear(linear)
    with torch.no_grad():
        linear.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="beyond fp16's range"):
        Fp16Linear(linear)
    with pytest.raises(ValueError, match="fp32 layers"):
        Fp16Linear(nn.Linear(4, 2).to(torch.bfloat16))


@needs_fp16
def test_fp16_packing_survives_deepcopy_and_quantization():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    x = torch.randn(5, 16)
    want = model(x)
    assert pack_linears(model, "fp16") == 2
    assert all(isinstance(model[i], Fp16Linear) for i in (0, 2))
    assert pack_linears(model, "fp16") == 0
    assert (model(x) - want).abs().max() <= 1e-3 * want.abs().max()
    clone = copy.deepcopy(model)
    assert clone[0].packed is not model[0].packed
    torch.testing.assert_close(clone(x), model(x), rtol=1e-5, atol=1e-5)
    assert quantize_linears(clone) == 2
    assert isinstance(clone[0], QuantizedLinear)


needs_narrow_fp16 = pytest.mark.skipif(
    not (fp16_linear_works() and onednn_linear_works(torch.bfloat16)),
    reason="onednn+fp16 needs fbgemm's fp16 linear and oneDNN's bf16 one",
)


@needs_narrow_fp16
@pytest.mark.parametrize("bias", [False, True])
def test_narrow_fp16_linear_narrow_calls_take_the_fp16_copy_wide_ones_onednn(bias):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(640, 1536, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 640, generator=gen) / 25)
        if bias:
            linear.bias.copy_(torch.randn(1536, generator=gen))
    wide_only = OneDnnLinear(copy.deepcopy(linear))
    packed = NarrowFp16Linear(linear)
    assert packed.weight_bytes == 2 * linear.weight.numel()
    assert torch.equal(packed.weight, linear.weight)  # bf16 values held exactly
    for rows in (1, 2, NARROW_ROWS, NARROW_ROWS + 1, 9):
        x = torch.randn(rows, 640, generator=gen).to(torch.bfloat16)
        got = packed(x)
        assert got.shape == (rows, 1536) and got.dtype == torch.bfloat16
        if rows > NARROW_ROWS:
            assert torch.equal(got, wide_only(x))  # the oneDNN bf16 product itself
            continue
        # fp32 accumulation of the same values, rounded to bf16 once: the exact product's
        # bf16 rounding, summation order apart
        bias32 = None if linear.bias is None else linear.bias.float()
        want = F.linear(x.float(), linear.weight.float(), bias32)
        torch.testing.assert_close(
            got.float(), want, rtol=8e-3, atol=1e-5 * float(want.abs().max())
        )
        assert (got.float() - want).abs().max() <= (want.abs().max() * 2**-8)
    with pytest.raises(ValueError, match="bf16 layers"):
        NarrowFp16Linear(nn.Linear(4, 2))
    with torch.no_grad():
        linear.weight[0, 0] = 1e6
    with pytest.raises(ValueError, match="beyond fp16's range"):
        NarrowFp16Linear(linear)


@needs_narrow_fp16
def test_narrow_fp16_packing_survives_deepcopy_and_quantization():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    want = model(x).float()
    assert pack_linears(model, "onednn+fp16") == 2
    assert all(isinstance(model[i], NarrowFp16Linear) for i in (0, 2))
    assert (model(x).float() - want).abs().max() <= 2e-2 * want.abs().max()
    clone = copy.deepcopy(model)
    assert clone[0].packed is not model[0].packed
    assert torch.equal(clone(x), model(x))
    assert quantize_linears(clone) == 2
    assert isinstance(clone[0], QuantizedLinear)


@needs_narrow_fp16
def test_narrow_fp16_linear_in_a_compiled_graph_takes_the_same_path_as_eager():
    from kernels.compiled_step import compile_verified_here

    if not compile_verified_here():
        pytest.skip("compiled steps are verified on AVX-512 and AVX2 CPUs only")
    torch._dynamo.reset()
    linear = NarrowFp16Linear(nn.Linear(64, 48).to(torch.bfloat16))
    compiled = torch.compile(lambda x: torch.relu(linear(x)) * 2, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows in (2, NARROW_ROWS, NARROW_ROWS + 2):  # one graph: rows are symbolic
            x = torch.randn(rows, 64).to(torch.bfloat16)
            got = compiled(x)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, torch.relu(linear(x)) * 2)
