"""Fixtures every tier shares. Nothing here imports torch or the model at collection time:
the unit tier must collect without them (tests/unit/test_tiers.py checks)."""

from __future__ import annotations

import pytest

from kvcore.req_kv_info import enable_write_guard

# Every test runs with the record write guard on: a ReqKvInfo written outside the ledger's
# own context raises (tests that plant a broken record use `ledger_writes()`).
enable_write_guard()


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer bundle (tokenizer, chat template, special ids)."""
    from kernels.tokenizer_loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers' Gemma 3 from the same GGUF, fp32: the reference for parity tests."""
    import torch
    from transformers import AutoModelForCausalLM

    from kernels.gguf_loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
