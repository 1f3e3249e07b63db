"""`parallel.tensor_parallel_size = 2` through every actor, on the real embedded model: the
runner is rank 0 of a gloo group and starts rank 1 as a process of its own; the scheduler and
the allocator are the one-rank ones (one record per request, whatever the rank count).
Greedy output equals HF transformers token for token (fp32), ragged concurrent prompts with
chunked prefill and prefix reuse included, and the pools balance afterwards. What a split
runner cannot run fails the start with a message naming it. (A rank killed under load:
tests/e2e/test_reliability.py.)"""

from __future__ import annotations

import random

import pytest

from actors.app.serving import ServingEngine
from actors.runtime import SystemStartError
from tests.e2e.engine_fixtures import natural_text, random_prompts, settle, small_config
from tests.e2e.test_engine_e2e import hf_greedy
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.anyio, pytest.mark.model]


@pytest.fixture(scope="module")
async def tp_engine(anyio_backend):
    async with ServingEngine(small_config(parallel__tensor_parallel_size=2)) as eng:
        yield eng


async def test_two_ranks_match_hf_greedy(tp_engine, tokenizer, hf_model):
    rng = random.Random(5)
    prompts = random_prompts(tokenizer, 6, 5, 700, seed=23)
    max_tokens = [rng.randint(4, 10) for _ in prompts]
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    results = await tp_engine.generate_batch(prompts, params)
    for ids, m, res in zip(prompts, max_tokens, results):
        assert res.token_ids == hf_greedy(hf_model, ids, m, tokenizer.eos_ids), len(ids)
    assert max(len(p) for p in prompts) > 256  # chunked (chunk_size 256)
    await settle(tp_engine)


async def test_two_ranks_reuse_a_cached_prefix(tp_engine, tokenizer, hf_model):
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    shared = [tokenizer.bos_id] + ids[200:520]
    first = shared + ids[900:910]
    second = shared + ids[1500:1512]
    greedy = GenerationParams(max_tokens=6, temperature=0.0)
    await tp_engine.generate_batch([first], [greedy])
    (res,) = await tp_engine.generate_batch([second], [greedy])
    assert res.cached_tokens >= 320 - 16  # whole pages of the shared prefix
    assert res.token_ids == hf_greedy(hf_model, second, 6, tokenizer.eos_ids)
    await settle(tp_engine)


async def test_a_quantized_split_is_refused_at_start(anyio_backend):
    cfg = small_config(parallel__tensor_parallel_size=2, model__quantization="int8")
    with pytest.raises(SystemStartError, match="tensor parallelism splits exact weights"):
        async with ServingEngine(cfg):
            pass
