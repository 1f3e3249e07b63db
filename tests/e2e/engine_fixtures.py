"""Shared pieces of the end-to-end engine tests: configs, prompts, the balance check."""

from __future__ import annotations

import random

from actors.app.corpus import natural_text
from actors.app.serving import EngineConfig, ServingEngine


def small_config(**overrides) -> EngineConfig:
    base = dict(
        kv__num_pages=512,
        kv__page_size=16,
        kv__context_len=2048,
        kv__max_rows=40,
        scheduler__max_running_requests=32,
        scheduler__max_batch_tokens=1024,
        scheduler__chunk_size=256,
        engine__debug_checks=True,
        model__dtype="float32",  # HF parity is checked in fp32, on the exact weights
        model__linear="aten",  # (auto stores an fp32 model's weights in fp16)
        model__threads=1,
    )
    base.update(overrides)
    return EngineConfig.load(**base)


async def assert_balanced(eng: ServingEngine) -> None:
    """Idle engine: no request holds KV; free + tree == total; invariants hold."""
    stats = await eng.kv_stats(check_invariants=True)
    assert stats.records == 0, f"{stats.records} request records left: {stats}"
    assert stats.held_rows == 0 and stats.held_pages == 0, stats
    assert stats.free_pages + stats.tree_pages == stats.total_pages, stats
    assert stats.evictable_pages == stats.tree_pages, f"tree locks leaked: {stats}"


def random_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append([tokenizer.bos_id] + ids[start : start + length - 1])
    return out
