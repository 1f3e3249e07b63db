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
from kernels.quant import int8_pays_off, int8_supported, time_int8_and_exact
from tests.e2e.engine_fixtures import assert_balanced, small_config
from transport.messages.engine import GenerationParams

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not int8_supported(), reason="no int8 weight-only matmul here"),
]


def test_the_decision_follows_the_timings_and_names_them():
    pays, why = int8_pays_off(1e-4, 2e-4, torch.bfloat16)
    assert pays and "100 us vs bfloat16 200 us" in why
    pays, why = int8_pays_off(3e-4, 1e-4, torch.float32)
    assert not pays
    assert "slower than the exact float32 path" in why and 'quantization = "none"' in why


def test_the_timing_measures_both_products():
    int8_s, exact_s = time_int8_and_exact(64, 128, torch.float32, repeats=2)
    assert 0 < int8_s < 1 and 0 < exact_s < 1


@pytest.mark.model
async def test_int8_is_refused_at_start_where_it_is_slower(monkeypatch):
    monkeypatch.setattr(kernels.quant, "time_int8_and_exact", lambda *a, **k: (2e-3, 1e-3))
    with pytest.raises(SystemStartError, match="int8 weights are slower.*2000 us vs float32"):
        async with ServingEngine(small_config(model__quantization="int8")):
            pass


@pytest.mark.model
async def test_int8_serves_where_it_is_faster(monkeypatch):
    monkeypatch.setattr(kernels.quant, "time_int8_and_exact", lambda *a, **k: (1e-3, 2e-3))
    async with ServingEngine(small_config(model__quantization="int8")) as eng:
        params = GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        [result] = await eng.generate_batch([[2, 9259, 1902, 786, 236764]], params)
        assert len(result.token_ids) == 6
        await assert_balanced(eng)
