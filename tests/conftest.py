"""Fixtures every tier shares. Nothing here imports torch or the model at collection time:
the unit tier must collect without them (tests/unit/test_tiers.py checks)."""

from __future__ import annotations

import os

import pytest

from kvcore.req_kv_info import enable_write_guard

# Every test runs with the record write guard on: a ReqKvInfo written outside the ledger's
# own context raises (tests that plant a broken record use `ledger_writes()`).
enable_write_guard()

# Under pytest-xdist (bin/test picks the workers) each worker's torch gets its share of the
# cores: more compute threads than cores stall on OpenMP's barriers (a 3 s test took 35 s).
# Set before any test imports torch; the servers the tests start inherit it, and their
# `model.threads = 0` (auto) follows it.
if _workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    _share = max(1, len(os.sched_getaffinity(0)) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


# Servers the tests start serve eagerly: a background compile per server would take the
# cores from the suite (tests/e2e/test_compiled_step.py turns it on where it is tested).
os.environ.setdefault("KVACTOR_MODEL_COMPILE", "off")


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
