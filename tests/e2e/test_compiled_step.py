"""Compiled small steps in a served engine, on the real model.

Two engines one after the other, both fp32 with fbgemm's fp16-packed linears (the default
layout of a CPU without native bf16): one eager, one with `model.compile = "on"`. The
compiled one starts serving eagerly, compiles in the background and switches; the test waits
for the switch, then every request's steps (decode rows, draft verification with n-gram
speculation on, short prefill chunks) run through the graph. Greedy output must be the
eager engine's: token for token, except at a near-tie (the graph sums in another order,
~1e-5 on the logits), where the eager engine's two best logprobs are within 1e-3.
"""

from __future__ import annotations

import time

import anyio
import pytest

from actors.app.serving import ServingEngine
from kernels.compiled_step import compile_verified_here
from tests.e2e.engine_fixtures import natural_text, settle, small_config
from transport.messages.engine import GenerationParams

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.model,
    # a hardware gate: elsewhere the runner refuses model.compile = on (kernels/compiled_step)
    pytest.mark.skipif(
        not compile_verified_here(),
        reason="compiled steps are verified on AVX-512 and AVX2 CPUs only",
    ),
]

PARAMS = GenerationParams(max_tokens=40, temperature=0.0, logprobs=True, top_logprobs=2)
COMPILE_WAIT_S = 900.0  # a cold compile of both graphs on 2 cores takes minutes


def _prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    again = tokenizer.encode("\n\nThe same text again:\n\n", add_special_tokens=False)
    copy = [tokenizer.bos_id, *ids[:150], *again, *ids[:20]]  # drafts are accepted
    plain = [[tokenizer.bos_id, *ids[s : s + n]] for s, n in ((700, 40), (1500, 90), (2600, 9))]
    return [copy, *plain]


def _config(compile_mode: str):
    return small_config(model__linear="fp16", model__compile=compile_mode)


async def _compiled_ready(eng: ServingEngine) -> dict:
    deadline = time.monotonic() + COMPILE_WAIT_S
    while time.monotonic() < deadline:
        stats = await eng.actor_stats("runner")
        if stats["runner_compiled_ready"]:
            return stats
        await anyio.sleep(1.0)
    raise AssertionError(f"the runner did not compile its steps within {COMPILE_WAIT_S} s")


async def test_compiled_engine_serves_the_eager_engines_tokens(tokenizer):
    prompts = _prompts(tokenizer)
    async with ServingEngine(_config("off")) as eager:
        singly = [(await eager.generate_batch([p], PARAMS))[0] for p in prompts]
        # the same batch shapes as the compiled engine's: a narrow step (draft verification
        # of one request) and a wide one (four requests' rows) take different products,
        # whose rows may differ by the wide weight's rounding, compiled or not
        eager_together = await eager.generate_batch(prompts, PARAMS)
        stats = await eager.actor_stats("runner")
        assert stats["runner_compiled_ready"] == 0 and stats["runner_compiled_steps"] == 0
        await settle(eager)
    async with ServingEngine(_config("on")) as compiled:
        before = await _compiled_ready(compiled)
        alone = [(await compiled.generate_batch([p], PARAMS))[0] for p in prompts]
        together = await compiled.generate_batch(prompts, PARAMS)  # rows of several requests
        after = await compiled.actor_stats("runner")
        spec = await compiled.scheduler_stats()
        await settle(compiled)
    steps = after["runner_compiled_steps"] - before["runner_compiled_steps"]
    assert steps >= 40, after  # the graph served (not a silent eager fallback)
    direct = after["runner_compiled_direct_steps"] - before["runner_compiled_direct_steps"]
    assert direct >= 40, after  # ... called without entering Dynamo
    assert after["runner_compile_fallbacks"] == 0
    assert spec.spec_accepted_tokens > 0  # verification rows went through it too
    for reference, outputs in ((singly, alone), (eager_together, together)):
        for want, got in zip(reference, outputs):
            _same_or_near_tie(want, got)


def _same_or_near_tie(want, got) -> None:
    """Equal tokens up to the end, or up to a position where the eager run's two best
    candidates were within 1e-3 (and the compiled run took one of them)."""
    for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)):
        if a == b:
            assert abs(want.logprobs[i].logprob - got.logprobs[i].logprob) < 1e-3
            continue
        (first, lp1), (second, lp2) = want.logprobs[i].top[:2]
        assert b in (first, second) and abs(lp1 - lp2) < 1e-3, (i, want.logprobs[i], b)
        return
    assert len(got.token_ids) == len(want.token_ids)
