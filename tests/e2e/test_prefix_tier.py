"""Prefix-tree blocks below the pool on the real model: a long system prompt that pool
pressure evicts from the prefix tree is kept in the host tier, and the next request that
starts with it loads it instead of prefilling it, answering exactly as HF does."""

from __future__ import annotations

import pytest

from actors.app.serving import ServingEngine
from tests.e2e.engine_fixtures import natural_text, small_config
from tests.e2e.test_engine_e2e import hf_greedy
from tests.e2e.test_sessions import settled
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.model]


@pytest.mark.anyio
async def test_an_evicted_system_prompt_is_loaded_from_the_host_tier(tokenizer, hf_model):
    filler = tokenizer.encode(natural_text(), add_special_tokens=False)
    system = filler[:600]  # 37 whole pages of 16 tokens, and 8 tokens more
    params = GenerationParams(max_tokens=8, temperature=0.0)
    # 96 pages: four other 500-token prompts push the system prompt out of the pool.
    async with ServingEngine(small_config(kv__num_pages=96)) as eng:
        client = eng.client
        first = await client.complete(params, prompt_ids=system + filler[2000:2010])
        assert first.cached_tokens == 0
        for j in range(4):
            other = filler[700 + 300 * j : 1200 + 300 * j]
            await client.complete(GenerationParams(max_tokens=1), prompt_ids=other)
        kv = await eng.kv_stats()
        assert kv.evicted_pages >= 37 and kv.block_demotes > 0 and kv.prefix_blocks > 0
        ids = system + filler[2100:2112]
        before = (await eng.scheduler_stats()).prompt_tokens
        res = await client.complete(params, prompt_ids=ids)
        computed = (await eng.scheduler_stats()).prompt_tokens - before
        assert res.token_ids == hf_greedy(hf_model, ids, 8, tokenizer.eos_ids)
        assert res.cached_tokens >= 592, res.cached_tokens  # the system prompt's whole pages
        assert computed == len(ids) - res.cached_tokens
        kv = await settled(eng)
        assert kv.block_promotes == 1 and kv.block_loaded_tokens > 0
        assert kv.tier_failures == 0 and kv.idle_check_failures == 0
