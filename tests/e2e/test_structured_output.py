"""Constrained output and tool calls on the real model behind a real server (fp32), through
the official `openai` client and the ZeroMQ SDK.

- 50 seeded JSON schemas (nested objects, arrays, enums, required fields, bounded numbers,
  strings with patterns or lengths): every response parses and validates, greedy and at
  temperature 1.0, streaming and not, 16 at once;
- regex and choice constraints on 100 sampled outputs;
- tools: `required` and a named tool give calls whose arguments validate, streaming deltas
  reassemble to the same call, a follow-up turn with the tool's result is answered;
- free requests batched with constrained ones give the tokens they give alone;
- a schema the engine cannot compile is a 400 naming the problem.
The engine is idle (no KV held, no request record) after every test.
"""

from __future__ import annotations

import json
import random
import re

import anyio
import jsonschema
import openai
import pytest

from tests.e2e.server_fixtures import MODEL_NAME, wait_idle
from transport.client import KvactorClient, KvactorError
from transport.messages.engine import GenerationParams
from transport.messages.params import OutputConstraint

pytestmark = [pytest.mark.model]

CONCURRENCY = 16
MAX_TOKENS = 320


class AsyncClients:
    """A fresh `openai.AsyncOpenAI` per event loop (its connection pool belongs to one)."""

    def __init__(self, server) -> None:
        self.server = server
        self.current: openai.AsyncOpenAI | None = None

    def new(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.server.base_url}/v1",
            api_key=self.server.api_key,
            max_retries=0,
            timeout=300.0,
        )

    def __getattr__(self, name: str):
        assert self.current is not None, "use inside run_all"
        return getattr(self.current, name)


@pytest.fixture(scope="module")
def aclient(server):
    return AsyncClients(server)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=300.0
    ) as c:
        yield c


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    wait_idle(server)


# ---- seeded schemas --------------------------------------------------------------------------

WORDS = ["city", "name", "color", "size", "level", "note", "label", "kind", "code", "score"]


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["int", "num", "bool", "enum", "pattern", "string"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "num":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
    if kind == "pattern":
        return {
            "type": "string",
            "pattern": rng.choice(["^[A-Z][a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$"]),
        }
    return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}


def node(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return obj(rng, depth + 1)
    if depth < 2 and roll < 0.45:
        items = leaf(rng) if rng.random() < 0.6 else obj(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(1, 3)}
    return leaf(rng)


def obj(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 3 if depth else 4))
    props = {n: node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


SCHEMAS = [obj(random.Random(seed)) for seed in range(50)]


def test_the_seeded_schemas_cover_the_features():
    text = json.dumps(SCHEMAS)
    for feature in ('"enum"', '"pattern"', '"maxLength"', '"minimum"', '"array"', '"boolean"'):
        assert feature in text, feature
    assert any(
        p.get("type") == "object" for s in SCHEMAS for p in s["properties"].values()
    )  # nested objects


async def json_answer(aclient, schema: dict, temperature: float, stream: bool, seed: int) -> str:
    kw = dict(
        model=MODEL_NAME,
        messages=[
            {
                "role": "user",
                "content": "Reply with a JSON object that follows this schema: "
                + json.dumps(schema),
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    if not stream:
        resp = await aclient.chat.completions.create(**kw)
        assert resp.choices[0].finish_reason == "stop", resp
        return resp.choices[0].message.content
    parts, finish = [], None
    async for chunk in await aclient.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    return "".join(parts)


def run_all(clients: AsyncClients, jobs, concurrency: int = CONCURRENCY) -> list:
    """Run async jobs, `concurrency` at once, in one event loop with one client; results in
    job order."""

    async def main() -> list:
        results: list = [None] * len(jobs)
        limit = anyio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with limit:
                results[i] = await jobs[i]()

        async with clients.new() as clients.current:
            async with anyio.create_task_group() as tg:
                for i in range(len(jobs)):
                    tg.start_soon(one, i)
        clients.current = None
        return results

    return anyio.run(main)


def test_fifty_json_schemas_always_validate(aclient):
    # Every schema greedy (not streamed) and sampled at 1.0 (streamed); ten of them the
    # other way round as well, where the greedy stream must equal the greedy response.
    cases = [(i, 0.0, False) for i in range(50)] + [(i, 1.0, True) for i in range(50)]
    cases += [(i, 0.0, True) for i in range(10)] + [(i, 1.0, False) for i in range(10)]
    jobs = [
        (lambda i=i, t=t, s=s: json_answer(aclient, SCHEMAS[i], t, s, seed=100 + i))
        for i, t, s in cases
    ]
    texts = run_all(aclient, jobs)
    for (i, t, s), text in zip(cases, texts):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"schema {i} t={t} stream={s}: {text!r}: {exc}") from None
    greedy = {i: text for (i, t, s), text in zip(cases, texts) if t == 0.0 and not s}
    for (i, t, s), text in zip(cases, texts):
        if t == 0.0 and s:
            assert text == greedy[i], i


def test_regex_and_choice_hold_on_a_hundred_samples(aclient):
    pattern = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3} years old\."
    choices = ["positive", "negative", "neutral", "it depends"]

    async def regex(seed: int) -> str:
        resp = await aclient.completions.create(
            model=MODEL_NAME,
            prompt="Write one sentence about a person's age:",
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        return resp.choices[0].text

    async def choice(seed: int) -> str:
        resp = await aclient.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Sentiment of: 'the food was cold'?"}],
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            # vLLM's older field, still what many clients send
            extra_body={"guided_choice": choices} if seed % 2 else {
                "structured_outputs": {"choice": choices}
            },
        )  # fmt: skip
        return resp.choices[0].message.content

    jobs = [lambda s=s: regex(s) for s in range(50)] + [lambda s=s: choice(s) for s in range(50)]
    texts = run_all(aclient, jobs)
    for text in texts[:50]:
        assert re.fullmatch(pattern, text), text
    for text in texts[50:]:
        assert text in choices, text
    assert len(set(texts[50:])) > 1  # sampled, not one fixed answer


def test_json_object_mode_on_completions_and_chat(client):
    # JSON mode leaves strings unbounded; a repetition penalty keeps this small model from
    # looping inside one until max_tokens (the cut text would not parse).
    resp = client.completions.create(
        model=MODEL_NAME,
        prompt="The name and age of a cat, as a JSON object:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}, "repetition_penalty": 1.3},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].text), dict)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give the name and age of a dog as JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body={"repetition_penalty": 1.3},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_free_requests_are_unchanged_by_constrained_neighbours(aclient):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Oslo is"]

    async def free(prompt: str) -> str:
        resp = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0
        )
        return resp.choices[0].text

    async def constrained(i: int) -> str:
        resp = await aclient.completions.create(
            model=MODEL_NAME,
            prompt="A JSON object:",
            max_tokens=24,
            temperature=1.0,
            seed=i,
            extra_body={"structured_outputs": {"json": SCHEMAS[i]}},
        )
        return resp.choices[0].text

    alone = run_all(aclient, [lambda p=p: free(p) for p in prompts])
    mixed_jobs = []
    for i, p in enumerate(prompts):
        mixed_jobs += [lambda i=i: constrained(2 * i), lambda p=p: free(p)]
        mixed_jobs += [lambda i=i: constrained(2 * i + 1)]
    mixed = run_all(aclient, mixed_jobs)
    assert [mixed[3 * i + 1] for i in range(len(prompts))] == alone


# ---- tools -----------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_required_tool_choice_returns_valid_calls_and_streams_the_same(client):
    # One call: with parallel calls allowed this small model repeats its call until
    # max_tokens (each of them valid: the next test).
    kw = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    resp = client.chat.completions.create(max_tokens=200, **kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)

    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(max_tokens=200, stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] += (d.function.name or "") if d.function else ""
                slot["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_parallel_required_calls_are_each_valid(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=4,
    )
    choice = resp.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "length":  # the last call may be cut short: arguments so far
        *calls, last = calls
        assert last.function.name in SCHEMA_OF
    check_calls(calls)


@pytest.mark.parametrize("max_tokens", [4, 12, 20])
def test_a_named_call_cut_short_by_max_tokens_is_never_markup(client, max_tokens):
    """Before its name is whole the call is dropped; after, it is a call with its arguments
    so far, as OpenAI returns it; streamed the same. `<tool_call>` never reaches content."""
    kw = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=max_tokens,
        temperature=0,
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert all(name == "get_weather" and "<tool_call>" not in args for name, args in calls)
    streamed, content = {}, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:  # the usage event
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            slot = streamed.setdefault(d.index, ["", ""])
            slot[0] += d.function.name or ""
            slot[1] += d.function.arguments or ""
    assert not content and [tuple(v) for _, v in sorted(streamed.items())] == calls


def test_a_named_tool_is_called_and_its_result_answered(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What time is it in Oslo?"}],
        tools=TOOLS,
        tool_choice=named,
        max_tokens=100,
        temperature=0,
    )
    message = resp.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    check_calls(message.tool_calls)
    call = message.tool_calls[0]
    follow_up = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "user", "content": "What time is it in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_time", "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"time": "14:05"}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    answer = follow_up.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.tool_calls
    alone = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What time is it in Oslo?"}],
        max_tokens=1,
    )
    # The call and its result are in the prompt (written in the engine's tool format).
    assert follow_up.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_auto_tool_choice_answers_in_text_or_valid_calls(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    choice = resp.choices[0]
    if choice.message.tool_calls:
        assert len(choice.message.tool_calls) == 1
        assert choice.finish_reason in ("tool_calls", "length")  # free text may run long
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content


@pytest.mark.parametrize(
    "body, param, why",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
            'Unsupported type "nonsense"',
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "EBNF"),
        ({"guided_regex": "a+", "guided_json": {"type": "object"}}, None, "one way"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "no tool named",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice", "without tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "cannot"),
    ],
)
def test_constraints_the_engine_cannot_serve_are_refused(client, body, param, why):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, max_tokens=5, extra_body=body
        )
    error = info.value.body
    assert why in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_the_zeromq_sdk_takes_the_same_constraints(server):
    n = {"type": "integer", "minimum": 0, "maximum": 100}
    schema = {"type": "object", "properties": {"n": n}, "required": ["n"]}

    async def run() -> tuple:
        async with KvactorClient(server.zmq_address, api_key=server.api_key) as sdk:
            as_json = await sdk.complete(
                prompt="A JSON object with a number:",
                params=GenerationParams(
                    max_tokens=40,
                    temperature=0,
                    constraint=OutputConstraint(kind="json_schema", spec=json.dumps(schema)),
                ),
            )
            picked = await sdk.complete(
                prompt="Pick a fruit:",
                params=GenerationParams(
                    max_tokens=8,
                    temperature=1.0,
                    constraint=OutputConstraint(kind="choice", choices=["apple", "pear"]),
                ),
            )
            with pytest.raises(KvactorError, match="regex"):
                await sdk.complete(
                    prompt="x",
                    params=GenerationParams(constraint=OutputConstraint(kind="regex", spec="(")),
                )
            return as_json, picked

    as_json, picked = anyio.run(run)
    jsonschema.validate(json.loads(as_json.text), schema)
    assert picked.text in ("apple", "pear")
