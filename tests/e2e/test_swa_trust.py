"""Sliding-window KV in the default setup (the sliding layers in a pool of their own, prompts
keeping their sliding KV, `kv.swa_free_prompt = false`) after a request decoded past the
512-token window of Gemma 3's sliding layers: its output's pages stay in the prefix tree
although the window freed their sliding KV.

A later prompt that re-enters such an output (its prefix-cache hit is cut to where the last
window is intact, the rest recomputed in prefill chunks, or nothing matched at all with
prompt logprobs) must still answer exactly as HF does on the same tokens (issue 26: after
each chunk the tree's pages without sliding KV came into the row inside the next chunk's
window); the tree must heal (the same prompt again is a whole-prefix hit), and a streaming
session's turn after a turn that decoded past the window restores cleanly under
`engine.debug_checks`.

Every history (a 32-token prompt, 608 greedy tokens with ignore_eos: positions up to 639,
so the window freed the sliding KV of output positions [32, 112)) is decoded once, all at
once, on one module engine; each test re-enters its own history (a tree path healed by one
test cannot hide the defect from another). References: HF transformers' greedy tokens and
log-softmax on the same ids, fp32 on the exact weights.
"""

from __future__ import annotations

import anyio
import openai
import pytest
import torch

from actors.app.serving import ServingEngine
from tests.e2e.engine_fixtures import random_prompts, small_config
from tests.e2e.server_fixtures import MODEL_NAME, start_server, stop_server, wait_idle
from tests.e2e.test_engine_e2e import hf_greedy
from tests.e2e.test_sessions import settled
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.anyio, pytest.mark.model]

PAGE = 16
WINDOW = 512  # Gemma 3 270M's sliding window
LEAD = 32  # tokens of each history's prompt
OUT = 608  # its greedy output: decoded up to position LEAD + OUT - 1 = 639
# The window then freed the sliding KV of output positions [LEAD, floor_page(639 - 511)) =
# [32, 112): 80 positions inside the last window of every prompt that ends before 112 + 511.
REENTER = 520  # re-entering prompts take the history's first REENTER output tokens (to 552)
NEW = 16  # greedy tokens asked of a re-entering prompt

# The default sliding setup, spelled out; window freeing in steps of 16 tokens; prefill in
# chunks of 64 tokens (a ~560-token prompt recomputed from 32 takes 9 chunks).
KV_SETUP = dict(
    kv__swa_num_pages=-1,
    kv__swa_free_prompt=False,
    kv__swa_free_step=16,
    kv__num_pages=768,  # every history and re-entry fits: nothing is evicted
    scheduler__chunk_size=64,
)
SERVER_SETS = [
    "kv.swa_num_pages=-1",
    "kv.swa_free_prompt=false",
    "kv.swa_free_step=16",
    "kv.num_pages=768",
    "scheduler.chunk_size=64",
]
HISTORIES = ("plain", "prompt_logprobs", "diverge", "repeat", "http", "session")
TAIL = " Then, in a quite different voice, the narrator asked one more question:"
OTHER_ENDING = (
    " None of that happened. Instead, the committee met on a rainy Tuesday in a small room"
    " above the bakery, read the minutes aloud, argued about the budget for an hour and a"
    " half, and finally voted to postpone everything until the spring."
)


def floor_page(n: int) -> int:
    return n - n % PAGE


def greedy(max_tokens: int, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, temperature=0.0, **kw)


def hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """HF's log-probability of each prompt token after the first."""
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.fixture(scope="module")
async def engine(anyio_backend):
    async with ServingEngine(small_config(**KV_SETUP)) as eng:
        yield eng


@pytest.fixture(scope="module")
async def histories(engine, tokenizer):
    """name -> (prompt, output): each a 32-token prompt and its 608 greedy tokens, decoded
    together; "session" is the first turn of a streaming session (also returned: its id)."""
    prompts = random_prompts(tokenizer, len(HISTORIES), LEAD, LEAD, seed=26)
    assert len({p[1] for p in prompts}) == len(prompts)  # no two share a tree path
    sid = (await engine.client.open_session()).session_id
    params = greedy(OUT, ignore_eos=True)
    out: dict[str, tuple[list[int], list[int]]] = {}

    async def one(name: str, prompt: list[int]) -> None:
        kw = {"session_id": sid} if name == "session" else {}
        res = await engine.client.complete(params, prompt_ids=prompt, **kw)
        assert len(res.token_ids) == OUT and res.finish_reason == "length", (name, res)
        out[name] = (prompt, res.token_ids)

    with anyio.fail_after(540):
        async with anyio.create_task_group() as tg:
            for name, prompt in zip(HISTORIES, prompts):
                tg.start_soon(one, name, prompt)
    kv = await settled(engine)
    # The window did free output pages the tree (and the session) now hold.
    assert kv.swa_freed_pages >= len(HISTORIES) * (112 - LEAD) // PAGE, kv
    return {"sid": sid, **out}


def reentry(tokenizer, history, upto: int = REENTER, ending: str = TAIL) -> list[int]:
    """The history's prompt, its first `upto` output tokens, then new text."""
    prompt, output = history
    return prompt + output[:upto] + tokenizer.encode(ending, add_special_tokens=False)


@pytest.mark.parametrize("prompt_logprobs", [False, True], ids=["plain", "prompt_logprobs"])
async def test_a_prompt_reentering_an_output_past_the_window_answers_as_hf(
    engine, histories, tokenizer, hf_model, prompt_logprobs
):
    """Prompt + 520 output tokens + a sentence (560 tokens, its last window reaching back
    into the freed positions): the hit is cut (or, with prompt logprobs, nothing is matched)
    and the rest computed in 64-token chunks, each reading the last one's window."""
    name = "prompt_logprobs" if prompt_logprobs else "plain"
    ids = reentry(tokenizer, histories[name])
    assert WINDOW < len(ids) < 112 + WINDOW - 1
    want = hf_greedy(hf_model, ids, NEW, tokenizer.eos_ids)
    if not prompt_logprobs:
        with anyio.fail_after(300):
            res = await engine.client.complete(greedy(NEW), prompt_ids=ids)
        assert res.token_ids == want, f"cached_tokens {res.cached_tokens} of {len(ids)}"
    else:
        with anyio.fail_after(300):
            res = await engine.client.complete(greedy(NEW, prompt_logprobs=1), prompt_ids=ids)
        assert res.cached_tokens == 0  # prompt logprobs need every token's logits
        assert [lp.token_id for lp in res.prompt_logprobs] == ids
        got = torch.tensor([lp.logprob for lp in res.prompt_logprobs[1:]])
        diff = (got - hf_prompt_logprobs(hf_model, ids)).abs()
        assert diff.max() < 1e-4, (
            f"prompt logprobs off by {diff.max():.4g}, first at prompt position "
            f"{int(torch.nonzero(diff >= 1e-4)[0]) + 1} of {len(ids)}"
        )
        assert res.token_ids == want
    await settled(engine)


async def test_a_prompt_diverging_inside_an_output_past_the_window_answers_as_hf(
    engine, histories, tokenizer, hf_model
):
    """Shares the history up to position 532 (inside its output, past the window), then
    goes its own way for ~50 tokens."""
    ids = reentry(tokenizer, histories["diverge"], upto=500, ending=OTHER_ENDING)
    assert WINDOW < len(ids) < 112 + WINDOW - 1
    with anyio.fail_after(300):
        res = await engine.client.complete(greedy(NEW), prompt_ids=ids)
    want = hf_greedy(hf_model, ids, NEW, tokenizer.eos_ids)
    assert res.token_ids == want, f"cached_tokens {res.cached_tokens} of {len(ids)}"
    await settled(engine)


async def test_the_same_reentering_prompt_again_is_a_whole_prefix_hit(
    engine, histories, tokenizer, hf_model
):
    """The first time the hit is cut where the window lost its sliding KV; what it
    recomputed heals the tree, so the second and third times its whole page-aligned prefix
    (but the last token, which is computed) is cached, and every answer is HF's."""
    ids = reentry(tokenizer, histories["repeat"])
    results = []
    for _ in range(3):
        with anyio.fail_after(300):
            results.append(await engine.client.complete(greedy(8), prompt_ids=ids))
    cached = [r.cached_tokens for r in results]
    assert cached[0] < floor_page(len(ids) - 1)  # the window before the end was freed
    assert cached[1:] == [floor_page(len(ids) - 1)] * 2, f"cached {cached} of {len(ids)}"
    want = hf_greedy(hf_model, ids, 8, tokenizer.eos_ids)
    for k, r in enumerate(results):
        assert r.token_ids == want, f"time {k + 1} (cached {r.cached_tokens})"
    await settled(engine)


# ---- through the HTTP server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def swa_server():
    """A `bin/engine serve` process in this module's KV setup (fp32 exact, debug checks)."""
    handle = start_server(extra=SERVER_SETS)
    try:
        yield handle
    finally:
        stop_server(handle)


async def test_over_http_reentering_an_output_past_the_window(
    swa_server, histories, tokenizer, hf_model
):
    """The official `openai` client: a completion decodes 608 tokens past the window, then
    a prompt re-entering its output (token ids) is sent with vLLM's prompt_logprobs, then
    plainly, then again: HF's prompt logprobs and tokens every time, and the last time its
    whole page-aligned prefix is cached."""
    prompt, output = histories["http"]
    ids = reentry(tokenizer, histories["http"])
    want = tokenizer.decode(hf_greedy(hf_model, ids, NEW, tokenizer.eos_ids))
    want_lps = hf_prompt_logprobs(hf_model, ids)
    async with openai.AsyncOpenAI(
        base_url=f"{swa_server.base_url}/v1",
        api_key=swa_server.api_key,
        max_retries=0,
        timeout=300,
    ) as oa:
        first = await oa.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=OUT,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        # The server decoded the same tokens as the engine (fp32 is batch invariant): the
        # re-entering ids below follow its tree path.
        assert first.choices[0].text == tokenizer.decode(output)
        assert first.usage.completion_tokens == OUT
        with_lps = await oa.completions.create(
            model=MODEL_NAME,
            prompt=ids,
            max_tokens=NEW,
            temperature=0,
            extra_body={"prompt_logprobs": 0},
        )
        plps = with_lps.choices[0].model_extra["prompt_logprobs"]
        assert plps[0] is None and len(plps) == len(ids)
        got = torch.tensor([entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plps[1:])])
        diff = (got - want_lps).abs()
        assert diff.max() < 1e-4, (
            f"prompt logprobs off by {diff.max():.4g}, first at prompt position "
            f"{int(torch.nonzero(diff >= 1e-4)[0]) + 1} of {len(ids)}"
        )
        assert with_lps.choices[0].text == want
        again = []
        for _ in range(2):
            res = await oa.completions.create(
                model=MODEL_NAME, prompt=ids, max_tokens=NEW, temperature=0
            )
            again.append(res)
    texts = [r.choices[0].text for r in again]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in again]
    assert texts == [want, want], f"cached {cached} of {len(ids)}"
    assert cached[-1] == floor_page(len(ids) - 1), f"cached {cached} of {len(ids)}"
    wait_idle(swa_server)


# ---- streaming sessions (last: with issue 26's defect the invariant checker stopped the engine)


async def test_a_session_turn_after_one_decoded_past_the_window_restores(
    engine, histories, tokenizer, hf_model
):
    """The session's first turn (fixture) decoded 608 tokens, the window freeing its output
    from position 32 on; the next turn (the whole conversation, then a new sentence)
    restores the session's KV, under the invariant checker, and answers as HF does."""
    sid = histories["sid"]
    prompt, output = histories["session"]
    ids = reentry(tokenizer, histories["session"], upto=OUT)
    before = (await engine.kv_stats()).session_hit_tokens
    with anyio.fail_after(300):
        res = await engine.client.complete(greedy(NEW), prompt_ids=ids, session_id=sid)
    restored = (await engine.kv_stats(check_invariants=True)).session_hit_tokens - before
    kept = len(prompt) + len(output) - 1  # the last output token was never fed back
    assert (res.cached_tokens, restored) == (kept, kept)
    assert res.token_ids == hf_greedy(hf_model, ids, NEW, tokenizer.eos_ids)
    info = await engine.client.get_session(sid)
    assert info.turns == 2 and not info.busy
    await settled(engine)
    assert (await engine.client.close_session(sid)).closed
    kv = await settled(engine)
    assert kv.session_pages == 0 and kv.sessions_open == 0, kv
