"""The model tier: kernels (loaders, models, attention, sampling, lm_head) and the embedded
model's tokenizer, compared with HF transformers; tiny random-weight models where a real one
is not needed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def embedded_fp32():
    """(config, model) of the embedded Gemma 3 270M in float32."""
    import torch

    from kernels.models import load_model

    return load_model(None, torch.float32)
