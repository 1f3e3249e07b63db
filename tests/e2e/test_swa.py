"""Sliding-window KV on the real model: with the sliding layers in a pool of their own and
their pages freed as the window passes (prompts too), long prompts still give HF's greedy
tokens, alone and batched, and a prefix-cache hit is cut to where its last window is
intact (the rest recomputed, still HF's tokens).
"""

from __future__ import annotations

import pytest

from actors.app.serving import ServingEngine
from tests.e2e.engine_fixtures import random_prompts, small_config
from tests.e2e.test_engine_e2e import hf_greedy
from tests.e2e.test_sessions import settled
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.anyio, pytest.mark.model]

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
async def engine(anyio_backend):
    cfg = small_config(
        kv__context_len=3200,
        kv__num_pages=640,
        kv__swa_num_pages=240,
        kv__swa_free_prompt=True,
        kv__swa_free_step=16,
    )
    async with ServingEngine(cfg) as eng:
        yield eng


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    return {n: random_prompts(tokenizer, 1, n, n, seed=n)[0] for n in (1500, 3000)}


@pytest.fixture(scope="module")
def expected(long_prompts, hf_model, tokenizer):
    return {n: hf_greedy(hf_model, p, 64, tokenizer.eos_ids) for n, p in long_prompts.items()}


async def test_long_prompts_equal_hf_alone_and_batched(engine, long_prompts, expected):
    params = GenerationParams(max_tokens=64, **GREEDY)
    for n, prompt in long_prompts.items():
        (alone,) = await engine.generate_batch([prompt], [params])
        assert alone.token_ids == expected[n], f"{n}-token prompt alone"
    both = await engine.generate_batch(list(long_prompts.values()), [params, params])
    for (n, _), res in zip(long_prompts.items(), both):
        assert res.token_ids == expected[n], f"{n}-token prompt batched"
    kv = await settled(engine)
    assert kv.swa_total_pages == 240 and kv.swa_freed_pages > 0, kv


async def test_a_prefix_hit_is_reused_only_where_its_window_is_intact(
    engine, long_prompts, expected, hf_model, tokenizer
):
    prompt = long_prompts[1500]
    params = GenerationParams(max_tokens=64, **GREEDY)
    (first,) = await engine.generate_batch([prompt], [params])
    assert first.token_ids == expected[1500]
    committed = len(prompt) + len(first.token_ids) - 1  # the last sampled token: no KV
    # Continuing the whole conversation: the window before the hit is still there.
    follow = prompt + first.token_ids + tokenizer.encode(" And then?", add_special_tokens=False)
    (cont,) = await engine.generate_batch([follow], [GenerationParams(max_tokens=16, **GREEDY)])
    assert cont.cached_tokens == committed - committed % 16
    assert cont.token_ids == hf_greedy(hf_model, follow, 16, tokenizer.eos_ids)
    # A prompt sharing only the first 1400 tokens: every window ending there was freed.
    other = prompt[:1400] + tokenizer.encode(" A different ending.", add_special_tokens=False)
    (diff,) = await engine.generate_batch([other], [GenerationParams(max_tokens=16, **GREEDY)])
    assert diff.cached_tokens == 0
    assert diff.token_ids == hf_greedy(hf_model, other, 16, tokenizer.eos_ids)
    await settled(engine)
