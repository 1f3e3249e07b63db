"""Constraints wrapped by `actors.reasoning.wrap_constraint`, compiled by the grammar engine
(xgrammar) over a tiny character vocabulary that has `<think>` and `</think>` as tokens:

- each constraint kind (json_object, json_schema, regex, choice, grammar, structural tag
  with tool-call triggered tags) compiles, and accepts reasoning then the answer, with or
  without the opening tag, or (where the start allows it) the answer alone, and refuses an
  answer the original constraint refuses, after reasoning or not;
- outputs sampled from random logits under the wrapped constraint, split by the reasoning
  splitter of the same prompt, have content the original constraint accepts.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, models

from actors.reasoning import reasoning_format, wrap_constraint
from kernels.grammar import GrammarEngine
from kernels.sampling import Sampler
from tests.model.model_fixtures import char_vocab
from transport.messages.params import GenerationParams, OutputConstraint

EOS = 1
PIECES = ["<think>", "</think>", '{"', '": ', "yes", "no", "\n\n"]


VOCAB = char_vocab(PIECES, EOS)
TEXT = {i: t for t, i in VOCAB.items()}
CLOSE = VOCAB["</think>"]

R1 = reasoning_format("deepseek_r1")
QWEN3 = reasoning_format("qwen3")
R1_OPEN = "<｜Assistant｜><think>\n"  # starts in reasoning
QWEN = "<|im_start|>assistant\n"  # does not: the model may write a block
QWEN_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
CALL_TAG = {
    "type": "triggered_tags",
    "triggers": ["<tool_call>"],
    "tags": [
        {
            "type": "tag",
            "begin": '<tool_call>{"name": "f", "arguments": ',
            "content": {"type": "json_schema", "json_schema": SCHEMA},
            "end": "}</tool_call>",
        }
    ],
    "at_least_one": False,
    "stop_after_first": True,
}
# (constraint, answers it accepts, answers it refuses)
KINDS = {
    "json_object": (OutputConstraint(kind="json_object"), ['{"a": 1}', "{}"], ["[1]", "x"]),
    "json_schema": (
        OutputConstraint(kind="json_schema", spec=json.dumps(SCHEMA)),
        ['{"n": 3, "ok": true}', '{"n": 0, "ok": false}'],
        ['{"n": 12, "ok": true}', '{"ok": true}', "yes"],
    ),
    "regex": (OutputConstraint(kind="regex", spec="[0-9]{2}-[a-c]+"), ["12-ab"], ["1-a", "ab"]),
    "choice": (OutputConstraint(kind="choice", choices=["yes", "no"]), ["yes", "no"], ["maybe"]),
    "grammar": (
        OutputConstraint(kind="grammar", spec='root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
        ["(1,23)", "(4)"],
        ["()", "1,2"],
    ),
    "structural_tag": (
        OutputConstraint(
            kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": CALL_TAG})
        ),
        ['Sure. <tool_call>{"name": "f", "arguments": {"n": 1, "ok": true}}</tool_call>'],
        ['<tool_call>{"name": "f", "arguments": {"n": 10, "ok": true}}</tool_call>'],
    ),
}


@pytest.fixture(scope="module")
def engine() -> GrammarEngine:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    return GrammarEngine(tok, len(VOCAB), [EOS])


def accepts(engine: GrammarEngine, c: OutputConstraint, text: str) -> bool:
    """Whether the whole `text` then EOS is an output the constraint allows."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(engine.compile(c.kind, c.spec, c.choices))
    return bool(matcher.accept_string(text)) and bool(matcher.accept_token(EOS))


REASONED = ["<think>\nlet me think {[(\n</think>\n\n", "no tag here, then</think>", "</think>\n"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_lets_reasoning_through_first(engine, kind):
    orig, good, bad = KINDS[kind]
    unknown = wrap_constraint(R1, orig)  # start not known: either shape
    in_reasoning = wrap_constraint(R1, orig, R1_OPEN)
    outside = wrap_constraint(QWEN3, orig, QWEN)
    for answer in good:
        assert accepts(engine, orig, answer)
        for c in (unknown, in_reasoning):
            for thought in REASONED:
                assert accepts(engine, c, thought + answer), (thought, answer)
        assert accepts(engine, outside, "<think>\nhmm\n</think>\n\n" + answer)
        assert accepts(engine, outside, answer) and accepts(engine, unknown, answer)
        if kind == "structural_tag":
            continue  # free text before a call may hold anything, </think> included
        # a prompt in reasoning: it must be closed before the answer (else all is reasoning)
        assert not accepts(engine, in_reasoning, answer)
        assert not accepts(engine, outside, "hmm</think>" + answer)  # no block opened
        assert not accepts(engine, outside, "<think>hmm" + answer)  # never closed
    for answer in bad:
        assert not accepts(engine, orig, answer)
        for c in (unknown, in_reasoning, outside):
            assert not accepts(engine, c, "<think>\nhmm\n</think>\n\n" + answer), answer
            assert not accepts(engine, c, "hmm</think>" + answer), answer
    first = good[0]
    assert accepts(engine, in_reasoning, "a</think>\n\n\n\n" + first)
    if kind != "structural_tag":  # (free text before a call may be anything)
        # reasoning ends at the first </think>: a second one is the answer's
        assert not accepts(engine, in_reasoning, "a</think>b</think>" + first)
        # at most 4 whitespace characters between </think> and the answer
        assert not accepts(engine, in_reasoning, "a</think>\n\n\n\n\n" + first)


def generate(engine, c: OutputConstraint, seed: int, max_tokens: int = 200) -> tuple[str, bool]:
    """Sample with random logits (</think> favoured, so reasoning ends) under `c`."""
    sampler = Sampler()
    compiled = engine.compile(c.kind, c.spec, c.choices)
    sampler.add_request(7, GenerationParams(seed=seed, constraint=c), [], engine.matcher(compiled))
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(1, len(VOCAB), generator=rng) * 3
        logits[0, CLOSE] += 6.0
        token = sampler.sample([7], logits).tokens[0]
        if token == EOS:
            return "".join(out), True
        out.append(TEXT[token])
    return "".join(out), False


def content_ok(kind: str, content: str) -> bool:
    if kind in ("json_object", "json_schema"):
        value = json.loads(content)
        if kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch("[0-9]{2}-[a-c]+", content) is not None
    if kind == "choice":
        return content in ("yes", "no")
    if kind == "grammar":
        return re.fullmatch(r"\(\d+(,\d+)*\)", content) is not None
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice", "grammar"])
def test_sampled_outputs_split_into_reasoning_and_a_valid_answer(engine, kind):
    orig = KINDS[kind][0]
    checked = ended_with_reasoning = 0
    for i, (fmt, tail) in enumerate(((R1, R1_OPEN), (QWEN3, QWEN), (QWEN3, QWEN_OFF))):
        c = wrap_constraint(fmt, orig, tail)
        for seed in range(10 * i, 10 * i + 6):
            text, ended = generate(engine, c, seed)
            if not ended:
                continue  # cut short: nothing to check of the answer
            reasoning, content = fmt.split(text, tail)
            assert "</think>" not in reasoning and not content.startswith("\n")
            assert content_ok(kind, content), (fmt.name, tail, text)
            checked += 1
            ended_with_reasoning += "</think>" in text
    assert (
        checked >= 12 and ended_with_reasoning >= 3
    )  # reasoning did come first, and closed, in several
