"""Weight-only int8: each layer close to its exact product, the whole model close to fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.lm_head import LmHead
from kernels.quant import (
    Int8Linear,
    int8_supported,
    quantize_linears,
    quantize_model,
    quantize_rows,
)

pytestmark = pytest.mark.skipif(not int8_supported(), reason="no int8 weight-only matmul here")


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_rows_round_trip_within_half_a_step_of_the_stored_scale(scale_dtype):
    w = torch.randn(64, 128)
    q, scales = quantize_rows(w, scale_dtype)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.dtype == scale_dtype
    step = scales.float()[:, None]
    # q is rounded against the scale as stored: its own rounding leaves no per-row error.
    # (Where the rounded scale fell below max|w| / 127 the clamp at 127 may add a little.)
    err = (q.float() * step - w).abs()
    assert (err <= step / 2 + 1e-6 + (q.abs() == 127) * step * 2**-7 * 127).all()


@pytest.mark.skipif(not int8_supported(torch.bfloat16), reason="no bf16 int8 matmul here")
def test_bf16_activations_on_an_fp32_linear_return_fp32_close_to_the_exact_product():
    lin = nn.Linear(256, 96, bias=True)
    x = torch.randn(3, 5, 256)
    layer = Int8Linear(lin, activations=torch.bfloat16)
    assert layer.scales.dtype == torch.bfloat16
    out = layer(x)
    ref = lin(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 2e-2
    head = LmHead(torch.randn(1000, 64) * 0.05, backend="int8", int8_activations=torch.bfloat16)
    hidden = torch.randn(4, 64)
    logits = head(hidden)
    exact = F.linear(hidden, head.weight)
    assert logits.dtype == torch.float32 and (logits - exact).norm() / exact.norm() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_exact_product(dtype):
    if dtype == torch.bfloat16:
        from kernels.cpu import bf16_matmul_supported

        if not bf16_matmul_supported():
            pytest.skip("this CPU cannot run bf16 matmuls")
    lin = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(3, 5, 256, dtype=dtype)
    ref = lin(x).float()
    out = Int8Linear(lin)(x).float()
    assert out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 2e-2


def test_quantize_linears_replaces_every_linear_and_the_head_stays_close():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert quantize_linears(model) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    weight = torch.randn(1000, 64) * 0.05
    hidden = torch.randn(4, 64)
    exact = F.linear(hidden, weight)
    approx = LmHead(weight, backend="int8")(hidden)
    assert approx.dtype == torch.float32
    assert (approx - exact).norm() / exact.norm() < 2e-2


@pytest.mark.model
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
def test_int8_embedded_model_stays_close_to_fp32(embedded_fp32, tokenizer, activations):
    import copy

    from tests.model.model_fixtures import GreedyRunner, make_executor

    if not int8_supported(activations):
        pytest.skip(f"no int8 matmul with {activations} activations here")
    config, model = embedded_fp32
    prompt = tokenizer.encode("Count with me: 1, 2, 3, 4, 5,")
    exact_exec, exact_slots = make_executor(config, model, 1, 128)
    exact = GreedyRunner(exact_exec, exact_slots).generate([prompt], 6)[0]
    quantized = copy.deepcopy(model)
    head = quantize_model(quantized, config, activations)
    executor, slots = make_executor(config, quantized, 1, 128, lm_head=head)
    assert GreedyRunner(executor, slots).generate([prompt], 6)[0] == exact
