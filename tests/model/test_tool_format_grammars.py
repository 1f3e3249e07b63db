"""Each tool-call format's constraint, compiled by xgrammar over a tiny character vocabulary
and sampled from random logits: every output is calls its own parser reads, with valid
arguments; and the calls each format writes into the history are outputs its `required`
constraint accepts (writer, grammar and parser agree)."""

from __future__ import annotations

import json
import string

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, models

from actors.tool_calls import FORMATS, Tool, tool_format
from kernels.grammar import GrammarEngine
from kernels.sampling import Sampler
from tests.unit.tool_specs import TIME, WEATHER
from transport.messages.params import GenerationParams, OutputConstraint

FLAG = Tool(
    name="set_flag",
    parameters={
        "type": "object",
        "properties": {
            "on": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 8},
            "level": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["on"],
        "additionalProperties": False,
    },
)
TOOLS = {t.name: t for t in (WEATHER, TIME, FLAG)}
PIECES = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<function=", "<parameter=", "True")


@pytest.fixture(scope="module")
def engine() -> tuple[GrammarEngine, dict[int, str]]:
    vocab = {"<pad>": 0, "<eos>": 1}
    for c in string.printable:
        if c not in "\t\r\x0b\x0c":
            vocab[c] = len(vocab)
    for piece in PIECES:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return GrammarEngine(tok, len(vocab), [1]), {i: t for t, i in vocab.items()}


def sample(engine, spec: str, seed: int, push: str | None = None) -> str | None:
    """One output under `spec` from random logits (None if it ran past 400 tokens); `push`:
    a piece made likely at the third step (auto: a call after some text)."""
    grammar, text_of = engine
    constraint = OutputConstraint(kind="structural_tag", spec=spec)
    compiled = grammar.compile(constraint.kind, constraint.spec)
    sampler = Sampler()
    params = GenerationParams(temperature=1.0, seed=seed, constraint=constraint)
    sampler.add_request(1, params, [], grammar.matcher(compiled))
    rng = torch.Generator().manual_seed(seed)
    pushed = next((i for i, t in text_of.items() if t == push), None)
    out = []
    for step in range(400):
        logits = torch.randn(1, len(text_of), generator=rng) * 2
        if pushed is not None and step == 2:
            logits[0, pushed] += 30
        token = sampler.sample([1], logits).tokens[0]
        if token == 1:
            return "".join(out)
        out.append(text_of[token])
    return None


def check(fmt: str, text: str, mode: str, tools: list[Tool]) -> None:
    calls_only = mode != "auto"
    content, calls = tool_format(fmt).parse(text, calls_only, tools)
    assert calls, text
    if calls_only:
        assert content is None, text
    if mode in ("named", "required_single") or fmt in ("mistral", "pythonic") and mode == "auto":
        assert len(calls) >= 1
    if mode in ("named", "required_single"):
        assert len(calls) == 1, text
    for call in calls:
        assert call.name in {t.name for t in tools}, text
        jsonschema.validate(json.loads(call.arguments), TOOLS[call.name].parameters)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("mode", ["required", "named", "required_single", "auto"])
def test_every_sampled_output_is_valid_calls(engine, fmt, mode):
    tools = [TIME] if mode == "named" else list(TOOLS.values())
    spec = tool_format(fmt).constraint(
        mode.removesuffix("_single"), tools, parallel=mode != "required_single"
    )
    push = {
        "hermes": "<tool_call>",
        "qwen3_coder": "<tool_call>",
        "mistral": "[TOOL_CALLS]",
        "pythonic": "[",
        "llama3_json": "{",
    }[fmt]
    checked = 0
    for seed in range(6):
        text = sample(engine, spec, seed, push if mode == "auto" else None)
        if text is None:
            continue  # ran long (parallel calls, or free text): nothing to conclude
        if mode == "auto" and not tool_format(fmt).parse(text, tools=tools)[1]:
            continue  # free text that never reached the trigger
        check(fmt, text, mode, tools)
        checked += 1
    assert checked or mode == "auto"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_history_a_format_writes_is_what_its_constraint_accepts(engine, fmt):
    grammar, _ = engine
    import xgrammar as xgr

    f = tool_format(fmt)
    calls = [("get_weather", {"city": "Oslo", "days": 3}), ("set_flag", {"on": True})]
    written = f.write_calls(calls)
    spec = f.constraint("required", list(TOOLS.values()))
    matcher = xgr.GrammarMatcher(grammar.compile("structural_tag", spec))
    assert matcher.accept_string(written), written
    _, parsed = f.parse(written, calls_only=True, tools=list(TOOLS.values()))
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
