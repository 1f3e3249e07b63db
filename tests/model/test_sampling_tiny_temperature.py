"""A tiny temperature (below 1e-5, e.g. 1e-45) is greedy on both sampling paths.

Dividing logits by such a temperature overflows to inf and exp(inf - inf) is NaN, which used
to pick the last token id; the argmax is what the request means.
"""

from __future__ import annotations

import pytest
import torch

from kernels.device_sampling import sample_rows
from kernels.sampling import RowParams, Sampler
from transport.messages.params import GenerationParams

VOCAB = 64


def _logits(rows: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 3.0
    logits[:, 5] = 30.0  # the argmax, far from the last id
    return logits


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-8, 9.9e-6])
def test_tiny_temperature_is_greedy_on_the_cpu_path(temperature):
    sampler = Sampler()
    sampler.add_request(1, GenerationParams(temperature=temperature, seed=3), [])
    sampler.add_request(2, GenerationParams(temperature=temperature, top_p=0.9, seed=4), [])
    out = sampler.sample([1, 2], _logits(2))
    assert out.tokens == [5, 5]


@pytest.mark.parametrize("temperature", [1e-45, 1e-8])
def test_tiny_temperature_is_greedy_on_the_device_path(temperature):
    # sample_rows runs wherever its tensors are; on CPU tensors it is the GPU path's code.
    params = [RowParams.of(GenerationParams(temperature=temperature, top_k=8))] * 2
    tokens = sample_rows(_logits(2), params, [0.999, 0.5])
    assert tokens.tolist() == [5, 5]


def test_small_but_real_temperature_still_samples():
    params = RowParams.of(GenerationParams(temperature=1e-4))
    assert not params.is_greedy
