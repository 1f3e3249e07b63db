"""LmHead: every backend matches F.linear; plan selection, softcap, bf16, memory sharing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import bf16_matmul_supported
from kernels.linear import fp16_linear_works
from kernels.lm_head import (
    BACKENDS,
    FP16_PLAN_BUCKETS,
    LmHead,
    fp16_plan,
    narrow_fp16_plan,
    onednn_available,
)

VOCAB, HIDDEN = 4099, 64  # odd vocab: no backend may rely on a friendly multiple


def _weight(dtype: torch.dtype = torch.float32, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(vocab, HIDDEN, generator=generator) * 0.05).to(dtype)


def _hidden(n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n))


def _assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    scale = expected.abs().max().item()
    worst = (actual - expected).abs().max().item()
    assert worst <= rel * scale, f"max error {worst:.3e} exceeds {rel} x {scale:.3e}"


def _available(weight: torch.Tensor) -> list[str]:
    names = ["aten"]
    if onednn_available():
        names.append("onednn")
    if weight.dtype == torch.float32:
        names.append("numpy")
    if fp16_linear_works():
        names.append("fp16")
    return names


def _stored(weight: torch.Tensor, backend: str) -> torch.Tensor:
    """The weight as a backend multiplies it: fp16 rounds it, the rest keep it."""
    return weight.half().float() if backend == "fp16" else weight


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "q8_0"])  # test_q8_0_head
@pytest.mark.parametrize("n", [1, 3, 8, 32])
def test_fp32_backends_match_f_linear(backend: str, n: int) -> None:
    weight = _weight()
    if backend not in _available(weight):
        pytest.skip(f"{backend} unavailable here")
    head = LmHead(weight, backend=backend)
    hidden = _hidden(n)
    assert head.backend_for(n) == backend
    _assert_close_relative(head(hidden), F.linear(hidden, _stored(weight, backend)), 1e-5)


def test_auto_plan_uses_onednn_when_available_and_matches() -> None:
    weight = _weight()
    head = LmHead(weight)
    expected = "onednn" if onednn_available() else "aten"
    assert all(head.backend_for(n) == expected for n in (1, 2, 8, 32, 500))
    hidden = _hidden(5)
    _assert_close_relative(head(hidden), F.linear(hidden, weight), 1e-5)


def test_calibration_picks_a_measured_backend_per_bucket() -> None:
    weight = _weight()
    head = LmHead(weight, backend="calibrate", calibration_sizes=(1, 4, 16))
    assert set(head.plan) == {1, 4, 16}
    for size, times in head.calibration_ms.items():
        # fp16 changes the weights: only a plan that names it uses it
        assert set(times) == set(_available(weight)) - {"fp16"}
        assert head.plan[size] == min(times, key=times.__getitem__)
    # Between buckets the nearest one (log scale) decides; beyond the last, the last does.
    assert head.backend_for(2) == head.plan[4]  # tie between 1 and 4 goes to the larger
    assert head.backend_for(3) == head.plan[4]
    assert head.backend_for(1000) == head.plan[16]
    for n in (1, 3, 9, 40):
        hidden = _hidden(n)
        _assert_close_relative(head(hidden), F.linear(hidden, weight), 1e-5)


@pytest.mark.skipif(not fp16_linear_works(), reason="fbgemm's fp16 product does not run here")
def test_the_fp16_plan_keeps_fp16_weight_values_at_every_batch_size() -> None:
    weight = _weight()
    small, large = FP16_PLAN_BUCKETS
    head = LmHead(weight, backend=fp16_plan())
    assert head.plan == fp16_plan()
    assert head.calibration_ms == {}
    wide = "onednn" if onednn_available() else "fp16"
    rounded = weight.half().float()
    for n, backend in [(1, "fp16"), (small, "fp16"), (large, wide), (4 * large, wide)]:
        assert head.backend_for(n) == backend
        hidden = _hidden(n)
        # oneDNN's copy holds the fp16-rounded values too: one precision for every batch
        _assert_close_relative(head(hidden), F.linear(hidden, rounded), 1e-5)
    assert head._fp16 is not None and head._numpy_weight is not None
    assert (head._packed is not None) == onednn_available()
    # fp16 rounds the weights: logits within fp16's relative precision of the exact ones
    hidden = _hidden(3)
    _assert_close_relative(head(hidden), F.linear(hidden, weight), 2e-3)
    assert LmHead(weight, backend={4: "aten"})._fp16 is None
    assert LmHead(weight, backend="aten")._fp16 is None
    # a plan without fp16 keeps oneDNN's copy exact
    if onednn_available():
        exact = LmHead(weight, backend={1: "onednn"})
        _assert_close_relative(exact(hidden), F.linear(hidden, weight), 1e-5)


def test_bad_plans_and_fp16_refusals() -> None:
    with pytest.raises(ValueError, match="positive batch sizes"):
        LmHead(_weight(), backend={0: "aten"})
    with pytest.raises(ValueError, match="positive batch sizes"):
        LmHead(_weight(), backend={})
    with pytest.raises(ValueError, match="unknown lm_head backend 'calibrate'"):
        LmHead(_weight(), backend={1: "calibrate"})
    with pytest.raises(ValueError, match="unknown lm_head backend 'int8'"):
        LmHead(_weight(), backend={1: "aten", 8: "int8"})
    with pytest.raises(ValueError, match="pair it with onednn only"):
        LmHead(_weight(), backend={1: "fp16", 8: "aten"})
    if fp16_linear_works():
        huge = _weight()
        huge[3, 5] = 1e5
        with pytest.raises(ValueError, match="beyond fp16's range"):
            LmHead(huge, backend="fp16")


def test_weight_is_shared_and_packed_copy_only_kept_when_used() -> None:
    weight = _weight()
    aten = LmHead(weight, backend="aten")
    assert aten.weight.data_ptr() == weight.data_ptr()
    assert aten._packed is None  # no second copy when the plan never uses it
    if onednn_available():
        assert LmHead(weight, backend="onednn")._packed is not None


@pytest.mark.skipif(
    not bf16_matmul_supported(),
    reason="this CPU cannot run bf16 matmuls (oneDNN needs avx512bw/vl/dq or avx_ne_convert)",
)
def test_bf16_weight_gives_float32_logits_close_to_fp32_product() -> None:
    weight = _weight(torch.bfloat16)
    hidden = _hidden(8)
    reference = F.linear(hidden.bfloat16().float(), weight.float())
    for backend in _available(weight):
        head = LmHead(weight, backend=backend)
        # bf16 logits carry 8 mantissa bits: about 4e-3 of the largest logit.
        _assert_close_relative(head(hidden), reference, 1e-2)


@pytest.mark.skipif(
    not (bf16_matmul_supported() and fp16_linear_works() and onednn_available()),
    reason="needs oneDNN's bf16 product and fbgemm's fp16 one",
)
def test_the_narrow_fp16_plan_of_a_bf16_weight_keeps_bf16_logits_at_every_batch_size() -> None:
    weight = _weight(torch.bfloat16)
    head = LmHead(weight, backend=narrow_fp16_plan())
    assert head.plan == narrow_fp16_plan() == {4: "fp16", 8: "onednn"}
    assert [head.backend_for(n) for n in (1, 4, 5, 6, 8, 32)] == ["fp16"] * 3 + ["onednn"] * 3
    hidden = _hidden(9).bfloat16()
    reference = F.linear(hidden.float(), weight.float())
    wide = head(hidden)
    for n in (1, 3):
        narrow = head(hidden[:n])
        # rounded to bf16 as the oneDNN product's logits are: one precision whatever the
        # batch, the two differing by summation order (at most a bf16 step) only
        assert torch.equal(narrow, narrow.bfloat16().float())
        _assert_close_relative(narrow, reference[:n], 1e-2)
        _assert_close_relative(narrow, wide[:n], 1e-2)
    assert head._fp16 is not None and head._packed is not None


def test_softcap_and_leading_dims() -> None:
    weight = _weight()
    head = LmHead(weight, final_softcap=0.5)
    hidden = _hidden(6).view(2, 3, HIDDEN)
    expected = torch.tanh(F.linear(hidden, weight) / 0.5) * 0.5
    out = head(hidden)
    assert out.shape == (2, 3, VOCAB)
    _assert_close_relative(out, expected, 1e-5)
    assert out.abs().max().item() <= 0.5


def test_empty_batch_and_bad_inputs() -> None:
    head = LmHead(_weight())
    assert head(torch.empty(0, HIDDEN)).shape == (0, VOCAB)
    with pytest.raises(ValueError, match="hidden size"):
        head(torch.zeros(1, HIDDEN + 1))
    with pytest.raises(ValueError, match="2-D"):
        LmHead(torch.zeros(3))
    with pytest.raises(ValueError, match="must be one of"):
        LmHead(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="unknown lm_head backend"):
        LmHead(_weight(), backend="cuda")
    with pytest.raises(ValueError, match="numpy"):
        LmHead(_weight(torch.bfloat16), backend="numpy")
    with pytest.raises(ValueError, match="final_softcap"):
        LmHead(_weight(), final_softcap=0.0)


def test_output_is_a_normal_tensor_usable_in_place_outside_inference_mode() -> None:
    logits = LmHead(_weight())(_hidden(2))
    logits.add_(1.0)  # the sampler edits logits in place; inference tensors would refuse
    assert logits.is_contiguous()


def test_gemma_sized_head_matches_f_linear() -> None:
    weight = torch.randn(262144, 640, generator=torch.Generator().manual_seed(1)) * 0.02
    head = LmHead(weight)
    for n in (1, 8):
        hidden = torch.randn(n, 640, generator=torch.Generator().manual_seed(n))
        _assert_close_relative(head(hidden), F.linear(hidden, weight), 1e-5)
