"""Weight-only int8 and int4: each layer close to its exact product, the whole model close to
fp32 (int8) or still coherent (int4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.lm_head import LmHead
from kernels.models import quantize_model
from kernels.quant import (
    INT4_GROUP,
    QuantizedLinear,
    dequantize_groups,
    pack_int4,
    quantize_groups,
    quantize_linears,
    quantize_rows,
    quantized_supported,
)

BF16, FP32 = torch.bfloat16, torch.float32
# How far each kind's product may move from the exact one on random Gaussian weights
# (relative Frobenius error): int8 keeps 255 levels per row, int4 16 per group of 32.
TOLERANCE = {"int8": 2e-2, "int4": 0.15}


def _needs(kind: str, activations: torch.dtype = FP32) -> None:
    if not quantized_supported(kind, activations):
        pytest.skip(f"no {kind} weight-only matmul with {activations} activations here")


@pytest.mark.parametrize("scale_dtype", [FP32, BF16])
def test_rows_round_trip_within_half_a_step_of_the_stored_scale(scale_dtype):
    w = torch.randn(64, 128)
    q, scales = quantize_rows(w, scale_dtype)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.dtype == scale_dtype
    step = scales.float()[:, None]
    # q is rounded against the scale as stored: its own rounding leaves no per-row error.
    # (Where the rounded scale fell below max|w| / 127 the clamp at 127 may add a little.)
    err = (q.float() * step - w).abs()
    assert (err <= step / 2 + 1e-6 + (q.abs() == 127) * step * 2**-7 * 127).all()


@pytest.mark.parametrize("scale_dtype", [FP32, BF16])
def test_groups_are_4_bit_and_their_refit_beats_the_min_max_grid(scale_dtype):
    w = torch.randn(48, 4 * INT4_GROUP)
    q, scales_zeros = quantize_groups(w, scale_dtype)
    assert q.dtype == torch.int32 and q.min() >= 0 and q.max() <= 15
    assert scales_zeros.shape == (4, 48, 2) and scales_zeros.dtype == scale_dtype
    err = (dequantize_groups(q, scales_zeros) - w).pow(2).sum()
    q0, sz0 = quantize_groups(w, scale_dtype, rounds=0)  # the plain min/max grid
    err0 = (dequantize_groups(q0, sz0) - w).pow(2).sum()
    assert err < 0.9 * err0


def test_a_weight_on_a_4_bit_grid_round_trips_exactly():
    # Every group uses levels 0 and 15, so its min/max grid is the weight's own.
    q = torch.randint(0, 16, (32, 2 * INT4_GROUP), dtype=torch.int32)
    q[:, 0], q[:, INT4_GROUP] = 0, 15
    q[:, 1], q[:, INT4_GROUP + 1] = 15, 0
    scale = torch.rand(32, 2) * 0.1 + 0.01
    low = torch.randn(32, 2) * 0.1
    w = q.float() * scale.repeat_interleave(INT4_GROUP, 1) + low.repeat_interleave(INT4_GROUP, 1)
    got_q, scales_zeros = quantize_groups(w, FP32)
    torch.testing.assert_close(dequantize_groups(got_q, scales_zeros), w, rtol=0, atol=1e-5)


def test_int4_rejects_input_widths_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="groups of 32 input channels; 48"):
        quantize_groups(torch.randn(16, 48))


@pytest.mark.parametrize("out_features", [16, 40, 1000])
def test_the_int4_kernel_computes_the_dequantized_product_at_any_output_width(out_features):
    _needs("int4")
    w = torch.randn(out_features, 2 * INT4_GROUP)
    q, scales_zeros = quantize_groups(w, FP32)
    packed, padded = pack_int4(q, scales_zeros)
    from kernels.quant import int4_product

    x = torch.randn(3, 2 * INT4_GROUP)
    got = int4_product(x, packed, padded, out_features)
    assert got.shape == (3, out_features)
    want = x @ dequantize_groups(q, scales_zeros).t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bf16_activations_on_an_fp32_linear_return_fp32_close_to_the_exact_product(kind):
    _needs(kind, BF16)
    lin = nn.Linear(256, 96, bias=True)
    x = torch.randn(3, 5, 256)
    layer = QuantizedLinear(lin, kind, activations=BF16)
    assert layer.kind == kind and layer.quantized.tensors[1].dtype == BF16
    out = layer(x)
    ref = lin(x)
    assert out.dtype == FP32 and out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < TOLERANCE[kind]
    head = LmHead(torch.randn(1000, 64) * 0.05, backend=kind, quantized_activations=BF16)
    hidden = torch.randn(4, 64)
    logits = head(hidden)
    exact = F.linear(hidden, head.weight)
    assert logits.dtype == FP32 and (logits - exact).norm() / exact.norm() < TOLERANCE[kind]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_quantized_linear_is_close_to_the_exact_product(kind, dtype):
    if dtype == BF16:
        from kernels.cpu import bf16_matmul_supported

        if not bf16_matmul_supported():
            pytest.skip("this CPU cannot run bf16 matmuls")
    _needs(kind, dtype)
    lin = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(3, 5, 256, dtype=dtype)
    ref = lin(x).float()
    out = QuantizedLinear(lin, kind)(x).float()
    assert out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < TOLERANCE[kind]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_linears_replaces_every_linear_and_the_head_stays_close(kind):
    _needs(kind)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16)))
    assert quantize_linears(model, kind) == 2
    assert isinstance(model[0], QuantizedLinear) and isinstance(model[2][0], QuantizedLinear)
    assert model[0].kind == kind
    weight = torch.randn(1000, 64) * 0.05
    hidden = torch.randn(4, 64)
    exact = F.linear(hidden, weight)
    approx = LmHead(weight, backend=kind)(hidden)
    assert approx.dtype == FP32
    assert (approx - exact).norm() / exact.norm() < TOLERANCE[kind]


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        QuantizedLinear(nn.Linear(32, 16), "int3")


@pytest.mark.model
@pytest.mark.parametrize("activations", [FP32, BF16])
def test_int8_embedded_model_stays_close_to_fp32(embedded_fp32, tokenizer, activations):
    import copy

    from tests.model.model_fixtures import GreedyRunner, make_executor

    _needs("int8", activations)
    config, model = embedded_fp32
    prompt = tokenizer.encode("Count with me: 1, 2, 3, 4, 5,")
    exact_exec, exact_slots = make_executor(config, model, 1, 128)
    exact = GreedyRunner(exact_exec, exact_slots).generate([prompt], 6)[0]
    quantized = copy.deepcopy(model)
    head = quantize_model(quantized, config, activations)
    executor, slots = make_executor(config, quantized, 1, 128, lm_head=head)
    assert GreedyRunner(executor, slots).generate([prompt], 6)[0] == exact


@pytest.mark.model
def test_int4_embedded_model_still_counts(embedded_fp32, tokenizer):
    """int4 moves the model's outputs (its perplexity: `bin/engine bench quality`), but a
    prompt the model is sure of keeps its greedy continuation."""
    import copy

    from tests.model.model_fixtures import GreedyRunner, make_executor

    activations = BF16 if quantized_supported("int4", BF16) else FP32
    _needs("int4", activations)
    config, model = embedded_fp32
    quantized = copy.deepcopy(model)
    head = quantize_model(quantized, config, activations, "int4")
    assert all(m.kind == "int4" for m in quantized.modules() if isinstance(m, QuantizedLinear))
    executor, slots = make_executor(config, quantized, 1, 128, lm_head=head)
    prompt = tokenizer.encode("Count with me: 1, 2, 3, 4, 5,")
    text = tokenizer.decode(GreedyRunner(executor, slots).generate([prompt], 6)[0])
    assert text.replace(" ", "").startswith("6,7,")
