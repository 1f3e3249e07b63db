"""The engine loop end to end on the real embedded model, through every actor.

Scheduler, allocator, radix cache, runner and tokenizer run as actors over
ZeroMQ (inproc); requests come through `EngineClient`, as the gateway's do.
After every scenario the KV pools must balance.
"""

from __future__ import annotations

import random
import time

import anyio
import pytest
import torch

from actors.app.serving import ServingEngine
from actors.frontends.base import GenerationError
from tests.e2e.engine_fixtures import (
    natural_text,
    random_prompts,
    settle,
    small_config,
)
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.anyio, pytest.mark.model]

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
async def engine(anyio_backend):
    async with ServingEngine(small_config()) as eng:
        yield eng


@pytest.fixture(autouse=True)
async def balanced_after(request, anyio_backend):
    yield
    eng = request.node.funcargs.get("engine") or request.node.funcargs.get("tiny_engine")
    if eng is not None:
        await settle(eng)  # in-flight aborts land, then the pools must balance


def hf_greedy(hf_model, ids: list[int], n: int, eos: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    gen = out[0, len(ids) :].tolist()
    for i, t in enumerate(gen):
        if t in eos:
            return gen[: i + 1]
    return gen


async def test_16_concurrent_requests_match_hf_greedy(engine, tokenizer, hf_model):
    rng = random.Random(3)
    prompts = random_prompts(tokenizer, 16, 5, 1200, seed=11)
    max_tokens = [rng.randint(3, 12) for _ in prompts]
    params = [GenerationParams(max_tokens=m, **GREEDY) for m in max_tokens]
    results = await engine.generate_batch(prompts, params)
    for ids, m, res in zip(prompts, max_tokens, results):
        expected = hf_greedy(hf_model, ids, m, tokenizer.eos_ids)
        assert res.token_ids == expected, f"prompt of {len(ids)} tokens diverged from HF"
        assert res.finish_reason == ("stop" if expected[-1] in tokenizer.eos_ids else "length")
        assert res.prompt_tokens == len(ids)
    assert max(len(p) for p in prompts) > 900


async def test_prefix_reuse_prefills_only_new_tokens(engine, tokenizer):
    ids = tokenizer.encode(natural_text(), add_special_tokens=True)
    shared = ids[1000:1600]
    first = [tokenizer.bos_id] + shared + ids[3000:3010]
    second = [tokenizer.bos_id] + shared + ids[4000:4020]
    r1 = await engine.client.complete(GenerationParams(max_tokens=2, **GREEDY), prompt_ids=first)
    before = await engine.scheduler_stats()
    r2 = await engine.client.complete(GenerationParams(max_tokens=2, **GREEDY), prompt_ids=second)
    after = await engine.scheduler_stats()
    page = engine.cfg.kv.page_size
    common = 1 + len(shared)
    assert r2.cached_tokens == (common // page) * page, (r1.cached_tokens, r2.cached_tokens)
    computed = after.prompt_tokens - before.prompt_tokens
    assert computed == len(second) - r2.cached_tokens


async def test_stop_strings_and_token_ids(engine, tokenizer):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = await engine.client.complete(GenerationParams(max_tokens=12, **GREEDY), prompt=prompt)
    assert " 8," in full.text
    cut = await engine.client.complete(
        GenerationParams(max_tokens=12, stop=[" 8,"], **GREEDY), prompt=prompt
    )
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(" 8,")]
    stop_id = full.token_ids[2]
    by_id = await engine.client.complete(
        GenerationParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY), prompt=prompt
    )
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:3]
    ml = await engine.client.complete(
        GenerationParams(max_tokens=5, min_tokens=5, ignore_eos=True, **GREEDY), prompt=prompt
    )
    assert len(ml.token_ids) == 5 and ml.finish_reason == "length"


async def test_bad_input_is_refused_and_changes_nothing(engine, tokenizer):
    before = await engine.kv_stats()
    bad = [
        dict(params=GenerationParams(max_tokens=0), prompt="x"),
        dict(params=GenerationParams(temperature=-1.0), prompt="x"),
        dict(params=GenerationParams(top_p=0.0), prompt="x"),
        dict(params=GenerationParams(), prompt_ids=[10**9]),
        dict(params=GenerationParams(), prompt=""),
        dict(params=GenerationParams(), prompt_ids=[5] * 5000),
    ]
    for kw in bad:
        too_long = len(kw.get("prompt_ids") or []) == 5000  # past the context
        with pytest.raises(GenerationError) as info:
            async for _ in engine.client.generate(kw.pop("params"), **kw):
                pass
        assert info.value.code == ("context_length_exceeded" if too_long else "invalid_request")
    after = await engine.kv_stats()
    assert (after.free_pages, after.records) == (before.free_pages, before.records)


async def _abort_when(engine, prompt_ids, params, condition) -> int:
    """Start a request, leave its stream when `condition(chunks)`; returns chunks seen."""
    seen = 0
    async for chunk in engine.client.generate(params, prompt_ids=prompt_ids):
        seen += 1
        if condition(seen):
            break
    return seen


async def test_abort_at_every_stage(engine, tokenizer):
    idle = await engine.kv_stats()
    ids = tokenizer.encode(natural_text())
    long_prompt = ids[:1500]  # several 256-token chunks
    params = GenerationParams(max_tokens=200, ignore_eos=True, **GREEDY)

    # Decoding: leave after 3 chunks.
    await _abort_when(engine, ids[:40], params, lambda n: n >= 3)
    # Mid chunked prefill: leave while the long prompt is still being prefilled.
    async with anyio.create_task_group() as tg:

        async def leave_early():
            with anyio.move_on_after(0.8):
                await _abort_when(engine, long_prompt, params, lambda n: True)

        tg.start_soon(leave_early)
    # Waiting: fill the batch, then abort one that has not started.
    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(_abort_when, engine, ids[k * 50 : k * 50 + 30], params, lambda n: n >= 2)
    for _ in range(100):
        s = await engine.scheduler_stats()
        if s.waiting == s.running == s.prefilling == 0:
            break
        await anyio.sleep(0.05)
    now = await engine.kv_stats(check_invariants=True)
    assert now.held_pages == 0 and now.records == 0
    assert now.free_pages + now.tree_pages == idle.free_pages + idle.tree_pages
    assert now.aborted >= idle.aborted + 5


async def test_decode_step_message_budget_is_constant(engine, tokenizer):
    ids = tokenizer.encode(natural_text())
    for batch in (1, 8):
        before = await engine.scheduler_stats()
        prompts = [ids[i * 20 : i * 20 + 12] for i in range(batch)]
        t = time.perf_counter()
        await engine.generate_batch(
            prompts, GenerationParams(max_tokens=10, ignore_eos=True, **GREEDY)
        )
        wall = time.perf_counter() - t
        after = await engine.scheduler_stats()
        assert after.decode_steps > before.decode_steps
        # The runner's own time in those steps, as it reported it: some, and within the wall.
        busy = after.runner_busy_s - before.runner_busy_s
        assert 0 < busy <= wall
    stats = await engine.scheduler_stats()
    assert stats.pure_decode_steps > 0
    assert stats.pure_decode_messages == 3 * stats.pure_decode_steps


@pytest.fixture(scope="module")
async def tiny_engine(anyio_backend):
    # 40 pages of 4 slots: far less than 64 concurrent requests need, so the scheduler
    # must retract and the allocator must evict to finish them all.
    cfg = small_config(
        kv__num_pages=40,
        kv__page_size=4,
        kv__max_rows=64,
        scheduler__max_running_requests=64,
        scheduler__max_batch_tokens=512,
        scheduler__chunk_size=64,
        scheduler__new_token_ratio=0.0,
        scheduler__min_new_token_ratio=0.0,
    )
    async with ServingEngine(cfg) as eng:
        yield eng


async def test_tiny_pool_64_requests_complete_with_retraction(tiny_engine, engine, tokenizer):
    ids = tokenizer.encode(natural_text())
    rng = random.Random(5)
    prompts = []
    for i in range(64):
        start = rng.randrange(0, 40) if i % 2 else rng.randrange(100, len(ids) - 40)
        prompts.append([tokenizer.bos_id] + ids[start : start + rng.randint(4, 20)])
    params = GenerationParams(max_tokens=8, ignore_eos=True, **GREEDY)
    reference = await engine.generate_batch(prompts, params)  # roomy pool, no retraction
    before = await tiny_engine.kv_stats()
    results = await tiny_engine.generate_batch(prompts, params)
    after = await tiny_engine.kv_stats(check_invariants=True)
    sched = await tiny_engine.scheduler_stats()
    assert all(r.finish_reason == "length" and len(r.token_ids) == 8 for r in results)
    assert sched.retractions > 0, "the tiny pool should have forced retractions"
    assert after.evicted_pages > before.evicted_pages, "the tiny pool should have evicted"
    for ref, got in zip(reference, results):
        assert got.token_ids == ref.token_ids


async def test_a_prompt_the_pool_cannot_hold_is_refused_and_the_engine_serves_on(
    tiny_engine, tokenizer
):
    """40 pages of 4 slots hold 160 tokens: a prompt of 161 cannot run even alone. It is
    refused at submission as bad input, naming the pool (it used to wait, then end with no
    token), changes nothing, and the next requests are served, one of them filling the
    pool: its first token comes from the prompt's last position."""
    ids = [tokenizer.bos_id] + tokenizer.encode(natural_text(), add_special_tokens=False)[:299]
    before = await tiny_engine.kv_stats()
    steps = (await tiny_engine.scheduler_stats()).steps
    with pytest.raises(GenerationError) as info:
        async for _ in tiny_engine.client.generate(
            GenerationParams(max_tokens=4), prompt_ids=ids[:161]
        ):
            pass
    assert info.value.code == "context_length_exceeded"
    assert "KV cache holds 160 tokens" in info.value.message, info.value.message
    assert (await tiny_engine.scheduler_stats()).steps == steps  # it never reached a step
    assert (await tiny_engine.kv_stats()).free_pages == before.free_pages
    await settle(tiny_engine)
    params = GenerationParams(max_tokens=1, ignore_eos=True, **GREEDY)
    [fits] = await tiny_engine.generate_batch([ids[:160]], params)
    assert len(fits.token_ids) == 1
    await settle(tiny_engine)
    params = GenerationParams(max_tokens=4, ignore_eos=True, **GREEDY)
    [ok] = await tiny_engine.generate_batch([ids[:20]], params)
    assert len(ok.token_ids) == 4
    await settle(tiny_engine)


async def test_prompt_logprobs_equal_hf_log_softmax(engine, tokenizer, hf_model):
    """Every prompt token after the first gets its logprob, as HF's log_softmax gives it,
    also across prefill chunks (chunk 256) and with the prompt's prefix already cached."""
    import torch

    ids = tokenizer.encode(natural_text()[:1500])
    assert len(ids) > 300  # more than one prefill chunk
    warm = GenerationParams(max_tokens=1, temperature=0.0)
    await engine.client.complete(warm, prompt_ids=ids)  # its prefix is now in the tree
    params = GenerationParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    res = await engine.client.complete(params, prompt_ids=ids)
    assert res.cached_tokens == 0  # prompt logprobs need every token's logits
    assert [lp.token_id for lp in res.prompt_logprobs] == ids
    assert res.prompt_logprobs[0].logprob is None and res.prompt_logprobs[0].top == []
    res.prompt_logprobs.pop(0)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([lp.logprob for lp in res.prompt_logprobs])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert all(len(lp.top) == 2 for lp in res.prompt_logprobs)
    best = ref[0].topk(2)
    assert [t for t, _, _ in res.prompt_logprobs[0].top] == best.indices.tolist()


async def test_logit_bias_forbids_and_forces(engine, tokenizer):
    ids = tokenizer.encode("Count with me: 1, 2, 3, 4, 5,")
    plain = await engine.client.complete(
        GenerationParams(max_tokens=4, temperature=0.0), prompt_ids=ids
    )
    first = plain.token_ids[0]
    banned = await engine.client.complete(
        GenerationParams(max_tokens=4, temperature=0.0, logit_bias={first: -100.0}), prompt_ids=ids
    )
    assert first not in banned.token_ids
    forced = await engine.client.complete(
        GenerationParams(max_tokens=3, temperature=0.0, logit_bias={1234: 100.0}), prompt_ids=ids
    )
    assert forced.token_ids == [1234, 1234, 1234]
