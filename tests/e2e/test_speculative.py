"""Speculative decoding on the real model: the same greedy output with it on and off.

Two engines side by side (fp32, exact weights): one with n-gram drafting (the default),
one without.
Every scenario runs on both and compares token ids (and logprobs); the drafting engine must
also have drafted and accepted, or the comparison proves nothing. Then the HTTP server with
vLLM's `--speculative-config`, through the official `openai` client: streams carry several
tokens per step, `/metrics` counts drafts, and a request may opt out.
"""

from __future__ import annotations

import json

import openai
import pytest

from actors.app.serving import ServingEngine
from tests.e2e.engine_fixtures import natural_text, small_config
from tests.e2e.engine_fixtures import settle as settle_one
from tests.e2e.server_fixtures import MODEL_NAME, scrape_metrics, start_server, stop_server
from tests.e2e.test_engine_e2e import hf_greedy
from transport.messages.engine import ChatMessage, GenerationParams
from transport.messages.params import OutputConstraint

pytestmark = [pytest.mark.anyio, pytest.mark.model]

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
async def engines(anyio_backend):
    # The sliding layers' pool frees prompts too, in small steps: the window moves under
    # every long request (debug checks on: the checker runs after every allocator message).
    swa = dict(kv__swa_free_prompt=True, kv__swa_free_step=16)
    spec = dict(speculative__method="ngram", speculative__num_speculative_tokens=4)
    async with (
        ServingEngine(small_config(**swa, speculative__method="none")) as plain,
        ServingEngine(small_config(**swa, **spec)) as drafting,
    ):
        yield plain, drafting


async def settle(*engines) -> None:
    for eng in engines:
        await settle_one(eng, tries=200)


def copy_prompt(tokenizer, start: int, length: int, cue: int = 24) -> list[int]:
    """A passage, then a cue to repeat it and its first `cue` tokens: the model copies, so
    prompt lookup drafts well."""
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)[start : start + length]
    # the text is ~3,600 tokens: a passage cut past its end left an 8-token prompt whose
    # drafting depended on the draws (a flaky test)
    assert len(ids) == length, f"the text has no {length} tokens from {start}"
    again = tokenizer.encode("\n\nThe same text again:\n\n", add_special_tokens=False)
    return [tokenizer.bos_id, *ids, *again, *ids[:cue]]


async def both(engines, prompts, params):
    plain, drafting = engines
    before = await drafting.scheduler_stats()
    a = await plain.generate_batch(prompts, params)
    b = await drafting.generate_batch(prompts, params)
    after = await drafting.scheduler_stats()
    await settle(plain, drafting)
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return a, b, drafted, accepted


async def test_copying_greedy_output_is_identical_and_drafts_are_accepted(engines, tokenizer):
    prompts = [copy_prompt(tokenizer, 400 * i, 200) for i in range(3)]
    params = GenerationParams(max_tokens=48, **GREEDY)
    for prompt in prompts:  # one stream at a time: every step may draft
        (a,), (b,), drafted, accepted = await both(engines, [prompt], params)
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish_reason == a.finish_reason and b.prompt_tokens == a.prompt_tokens
        assert accepted > 0 and drafted >= accepted, (drafted, accepted)
    # Three at once (max_batch 4): drafts verified beside each other in one forward.
    a, b, drafted, accepted = await both(engines, prompts, params)
    assert [r.token_ids for r in b] == [r.token_ids for r in a]
    assert accepted > 0


async def test_parity_prompts_equal_hf_greedy_with_drafting(engines, tokenizer, hf_model):
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    prompts = [[tokenizer.bos_id, *ids[s : s + n]] for s, n in ((0, 40), (900, 300), (2000, 7))]
    for prompt in prompts:
        (_, drafting) = engines
        (res,) = await drafting.generate_batch([prompt], GenerationParams(max_tokens=24, **GREEDY))
        assert res.token_ids == hf_greedy(hf_model, prompt, 24, tokenizer.eos_ids)
    await settle(*engines)


async def test_sliding_window_past_512_tokens(engines, tokenizer):
    """Gemma 3's sliding layers see 512 tokens: a copy that runs past them, drafted."""
    prompt = copy_prompt(tokenizer, 1000, 560, cue=8)
    assert len(prompt) > 512 + 20
    (a,), (b,), drafted, accepted = await both(
        engines, [prompt], GenerationParams(max_tokens=64, **GREEDY)
    )
    assert b.token_ids == a.token_ids
    assert accepted > 0


async def test_logprobs_stop_strings_and_max_tokens_inside_an_accepted_run(engines, tokenizer):
    prompt = copy_prompt(tokenizer, 3000, 160)
    lp = GenerationParams(max_tokens=32, logprobs=True, top_logprobs=3, **GREEDY)
    (a,), (b,), _, accepted = await both(engines, [prompt], lp)
    assert b.token_ids == a.token_ids and accepted > 0
    assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < 1e-3
        assert [t[0] for t in x.top] == [t[0] for t in y.top]
    # A stop string that falls inside the copied text: cut where it falls, the same text.
    words = a.text.split()
    stop = " ".join(words[3:5])
    (c,), (d,), _, _ = await both(
        engines, [prompt], GenerationParams(max_tokens=32, stop=[stop], **GREEDY)
    )
    assert d.text == c.text and d.finish_reason == c.finish_reason == "stop"
    assert d.token_ids == c.token_ids
    # max_tokens smaller than a run of accepted drafts.
    for m in (1, 2, 5):
        (e,), (f,), _, _ = await both(engines, [prompt], GenerationParams(max_tokens=m, **GREEDY))
        assert f.token_ids == e.token_ids and len(f.token_ids) == m


async def test_structured_output_drafts_are_checked_against_the_grammar(engines, tokenizer):
    doc = json.dumps({"name": "fox", "colour": "red", "legs": 4, "tags": ["quick", "brown"]})
    prompt = f"{doc}\n{doc}\n{doc}\n"
    schema = json.dumps(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "colour": {"type": "string"},
                "legs": {"type": "integer"},
            },
            "required": ["name", "colour", "legs"],
        }
    )
    params = GenerationParams(
        max_tokens=40,
        constraint=OutputConstraint(kind="json_schema", spec=schema),
        **GREEDY,
    )
    (a,), (b,), drafted, _ = await both(engines, [prompt], params)
    assert b.token_ids == a.token_ids
    assert set(json.loads(b.text)) >= {"name", "colour", "legs"}
    assert drafted > 0  # the copy cue made it draft (some drafts break the schema)


async def test_sessions_turns_are_identical(engines, tokenizer):
    outs = []
    for eng in engines:
        client = eng.client
        sid = (await client.open_session()).session_id
        messages: list[ChatMessage] = []
        turns = []
        text = " ".join(natural_text().split()[:80])
        for question in (f"Repeat this: {text}", "Once more, the same words.", "And again."):
            messages.append(ChatMessage(role="user", content=question))
            res = await client.complete(
                GenerationParams(max_tokens=40, **GREEDY), messages=list(messages), session_id=sid
            )
            turns.append((res.token_ids, res.cached_tokens))
            messages.append(ChatMessage(role="assistant", content=res.text))
        assert (await client.close_session(sid)).closed
        outs.append(turns)
    await settle(*engines)
    assert outs[1] == outs[0]  # same tokens, and the same KV kept by each session


async def test_sampled_requests_draft_unless_seeded(engines, tokenizer):
    """Unseeded sampled requests are verified by rejection sampling in the engine; seeded
    ones never draft, so their tokens do not depend on the load (kernels test the sampler's
    distribution: tests/model/test_speculative_sampling.py)."""
    from actors.speculation.policy import GREEDY_BELOW
    from kernels.device_sampling import GREEDY_TEMPERATURE_BELOW

    assert GREEDY_BELOW == GREEDY_TEMPERATURE_BELOW
    plain, drafting = engines
    prompt = copy_prompt(tokenizer, 2000, 200)
    free = GenerationParams(max_tokens=32, temperature=0.3)
    before = await drafting.scheduler_stats()
    await drafting.generate_batch([prompt], free)
    after = await drafting.scheduler_stats()
    assert after.spec_accepted_tokens > before.spec_accepted_tokens
    seeded = GenerationParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    (a,), (b,), drafted, _ = await both(engines, [prompt], seeded)
    assert drafted == 0 and b.token_ids == a.token_ids
    twice = await drafting.generate_batch([prompt, prompt], [seeded, seeded])
    assert twice[0].token_ids == twice[1].token_ids == a.token_ids
    await settle(*engines)


@pytest.fixture(scope="module")
def spec_server():
    handle = start_server(
        args=["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
    )
    try:
        yield handle
    finally:
        stop_server(handle)


def test_http_streams_several_tokens_a_step_and_metrics_count_drafts(spec_server, tokenizer):
    client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key=spec_server.api_key)
    words = " ".join(natural_text().split()[200:330])
    prompt = f"{words}\n\nThe same text again:\n\n{' '.join(words.split()[:6])}"
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=48, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=48, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and whole.usage.completion_tokens == 48
    assert len([c for c in chunks if c.choices and c.choices[0].text]) < 48  # runs arrive
    two = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=48, temperature=0, n=2
    )
    assert [c.text for c in two.choices] == [whole.choices[0].text] * 2
    opted_out = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        extra_body={"speculative": False},
    )
    assert opted_out.choices[0].text == whole.choices[0].text
    m = scrape_metrics(spec_server)
    drafts = m["vllm:spec_decode_num_drafts_total"]
    assert drafts > 0 and m["vllm:spec_decode_num_draft_tokens_total"] >= drafts
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= m["vllm:spec_decode_num_draft_tokens_total"]
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
