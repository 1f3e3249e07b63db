"""`model.quantization = "int8"` through the whole engine, and its refusal where it is slower.

The runner times torch's int8 kernel against the exact product on the model's own shape
before quantizing; these tests replace that timing (the machine's real one varies by CPU
and dtype) to drive both outcomes deterministically.
"""

from __future__ import annotations

import pytest
import torch

import kernels.quant
from actors.app.serving import ServingEngine
from actors.runtime import SystemStartError
from kernels.quant import choose_int8_activations, int8_supported, time_int8_products
from tests.e2e.engine_fixtures import assert_balanced, small_config
from transport.messages.engine import GenerationParams

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not int8_supported(), reason="no int8 weight-only matmul here"),
]
BF16, FP32 = torch.bfloat16, torch.float32


def test_the_decision_follows_the_timings_and_names_them():
    chosen, why = choose_int8_activations({BF16: 1e-4}, 2e-4, BF16)
    assert chosen == BF16
    assert "int8 with bfloat16 activations 100 us, exact bfloat16 200 us" in why
    # An fp32 model (an AVX2-only CPU): int8 with fp32 activations loses, with bf16 wins.
    chosen, why = choose_int8_activations({FP32: 6e-4, BF16: 1e-4}, 2e-4, FP32)
    assert chosen == BF16 and "faster here with bfloat16 activations" in why
    chosen, why = choose_int8_activations({FP32: 3e-4, BF16: 2.5e-4}, 1e-4, FP32)
    assert chosen is None
    assert "slower than the exact float32 path" in why and 'quantization = "none"' in why
    assert choose_int8_activations({}, 1e-4, FP32)[0] is None


def test_the_timing_measures_every_activation_dtype_that_runs_and_the_exact_product():
    int8_s, exact_s = time_int8_products(64, 128, FP32, repeats=2)
    expected = {FP32} | ({BF16} if int8_supported(BF16) else set())
    assert set(int8_s) == expected
    assert all(0 < s < 1 for s in int8_s.values()) and 0 < exact_s < 1


@pytest.mark.model
async def test_int8_is_refused_at_start_where_it_is_slower(monkeypatch):
    timings = ({FP32: 2e-3, BF16: 3e-3}, 1e-3)
    monkeypatch.setattr(kernels.quant, "time_int8_products", lambda *a, **k: timings)
    with pytest.raises(SystemStartError, match="int8 weights are slower.*2000 us"):
        async with ServingEngine(small_config(model__quantization="int8")):
            pass


@pytest.mark.model
async def test_int8_serves_where_it_is_faster(monkeypatch):
    # bf16 activations where the kernel runs them (on every CPU seen so far, AVX2 included):
    # on an fp32 model that is the mixed path an AVX2-only CPU gets.
    fastest = BF16 if int8_supported(BF16) else FP32
    timings = ({fastest: 1e-3}, 2e-3)
    monkeypatch.setattr(kernels.quant, "time_int8_products", lambda *a, **k: timings)
    async with ServingEngine(small_config(model__quantization="int8")) as eng:
        params = GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        [result] = await eng.generate_batch([[2, 9259, 1902, 786, 236764]], params)
        assert len(result.token_ids) == 6
        await assert_balanced(eng)
