"""`model.quantization = "int8" | "int4"` through the whole engine, and its refusal where it
is slower.

The runner times torch's quantized kernel against the exact product on the model's own
shape before quantizing; these tests replace that timing (the machine's real one varies by
CPU and dtype) to drive both outcomes deterministically.
"""

from __future__ import annotations

import pytest
import torch

import kernels.quant
from actors.app.serving import ServingEngine
from actors.runtime import SystemStartError
from kernels.quant import choose_activations, quantized_supported, time_quantized_products
from tests.e2e.engine_fixtures import assert_balanced, small_config
from transport.messages.engine import GenerationParams

pytestmark = [
    pytest.mark.anyio,
]
BF16, FP32 = torch.bfloat16, torch.float32


KINDS = pytest.mark.parametrize("kind", ["int8", "int4"])


def _needs(kind: str) -> None:
    if not quantized_supported(kind):
        pytest.skip(f"no {kind} weight-only matmul here")


def test_the_decision_follows_the_timings_and_names_them():
    chosen, why = choose_activations("int8", {BF16: 1e-4}, 2e-4, BF16)
    assert chosen == BF16
    assert "int8 with bfloat16 activations 100 us, exact bfloat16 200 us" in why
    # An fp32 model (an AVX2-only CPU): int4 with fp32 activations loses, with bf16 wins.
    chosen, why = choose_activations("int4", {FP32: 6e-4, BF16: 1e-4}, 2e-4, FP32)
    assert chosen == BF16 and "int4 weights are faster here with bfloat16 activations" in why
    chosen, why = choose_activations("int8", {FP32: 3e-4, BF16: 2.5e-4}, 1e-4, FP32)
    assert chosen is None
    assert "slower than the exact float32 path" in why and 'quantization = "none"' in why
    assert choose_activations("int4", {}, 1e-4, FP32)[0] is None


@KINDS
def test_the_timing_measures_every_activation_dtype_that_runs_and_the_exact_product(kind):
    _needs(kind)
    quantized_s, exact_s = time_quantized_products(kind, 64, 128, FP32, repeats=2)
    expected = {FP32} | ({BF16} if quantized_supported(kind, BF16) else set())
    assert set(quantized_s) == expected
    assert all(0 < s < 1 for s in quantized_s.values()) and 0 < exact_s < 1


@pytest.mark.model
@KINDS
async def test_a_quantization_is_refused_at_start_where_it_is_slower(monkeypatch, kind):
    _needs(kind)
    timings = ({FP32: 2e-3, BF16: 3e-3}, 1e-3)
    monkeypatch.setattr(kernels.quant, "time_quantized_products", lambda *a, **k: timings)
    with pytest.raises(SystemStartError, match=f"{kind} weights are slower.*2000 us"):
        async with ServingEngine(small_config(model__quantization=kind)):
            pass


@pytest.mark.model
@KINDS
async def test_a_quantization_serves_where_it_is_faster(monkeypatch, kind):
    # bf16 activations where the kernel runs them (on every CPU seen so far, AVX2 included):
    # on an fp32 model that is the mixed path an AVX2-only CPU gets.
    _needs(kind)
    fastest = BF16 if quantized_supported(kind, BF16) else FP32
    timings = ({fastest: 1e-3}, 2e-3)
    monkeypatch.setattr(kernels.quant, "time_quantized_products", lambda *a, **k: timings)
    async with ServingEngine(small_config(model__quantization=kind)) as eng:
        params = GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        [result] = await eng.generate_batch([[2, 9259, 1902, 786, 236764]], params)
        assert len(result.token_ids) == 6
        await assert_balanced(eng)
