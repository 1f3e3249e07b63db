"""Constrained decoding without a model: xgrammar over a tiny character vocabulary, the
bitmask applied in the batched sampler, the constraint's validation, and the structural
tag each `tool_choice` mode makes (every call sampled under it is valid).

The vocabulary is every printable character plus a few multi-character JSON pieces, so
random logits must be steered by the mask alone: every sampled output has to match.
"""

from __future__ import annotations

import json
import re
import string

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from actors.tool_calls import parse_tool_calls, tool_constraint
from kernels.grammar import (
    GrammarEngine,
    GrammarError,
    apply_token_bitmask,
    choice_grammar,
    constraint_key,
)
from kernels.sampling import Sampler
from tests.model.model_fixtures import char_vocab
from tests.unit.tool_specs import TIME, WEATHER
from transport.messages.params import (
    GenerationParams,
    InvalidParams,
    OutputConstraint,
    validate_params,
)

EOS = 1
PIECES = ['{"', '": ', '", "', "true", "false", "null", "  ", "😀"]


VOCAB = char_vocab(PIECES, EOS)
TEXT = {i: t for t, i in VOCAB.items()}
# A logits width past the tokenizer's (as models pad their vocabulary): the extra columns
# are never allowed for a constrained row.
WIDTH = len(VOCAB) + 5


@pytest.fixture(scope="module")
def engine() -> GrammarEngine:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    return GrammarEngine(tok, len(VOCAB), [EOS])


def generate(engine, constraint: OutputConstraint, seed: int, temperature=1.0, max_tokens=80):
    """Sample with random logits under the constraint; returns (text, ended with EOS)."""
    sampler = Sampler()
    compiled = engine.compile(constraint.kind, constraint.spec, constraint.choices)
    params = GenerationParams(temperature=temperature, seed=seed, constraint=constraint)
    sampler.add_request(7, params, [], engine.matcher(compiled))
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(1, WIDTH, generator=rng) * 3
        token = sampler.sample([7], logits).tokens[0]
        if token == EOS:
            return "".join(out), True
        out.append(TEXT[token])
    return "".join(out), False


def test_regex_choice_and_grammar_outputs_match(engine):
    pattern = r"[a-c]{2,4}-\d{3}"
    for seed in range(20):
        text, ended = generate(engine, OutputConstraint(kind="regex", spec=pattern), seed)
        assert ended and re.fullmatch(pattern, text), text
    choices = ["red", "green", 'say "hi"', "a\nb", "😀 ok"]
    for seed in range(20):
        text, ended = generate(engine, OutputConstraint(kind="choice", choices=choices), seed)
        assert ended and text in choices, text
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+'
    for seed in range(10):
        text, ended = generate(engine, OutputConstraint(kind="grammar", spec=ebnf), seed)
        assert ended and re.fullmatch(r"\(\d+(,\d+)*\)", text), text


def test_json_schema_outputs_validate(engine):
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["x", "y"]},
            "ok": {"type": "boolean"},
            "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["id", "tag", "ok", "name", "note"],
        "additionalProperties": False,
    }
    c = OutputConstraint(kind="json_schema", spec=json.dumps(schema))
    for seed in range(15):
        for temperature in (1.0, 0.0):
            text, ended = generate(engine, c, seed, temperature=temperature, max_tokens=120)
            assert ended, text
            jsonschema.validate(json.loads(text), schema)
    text, ended = generate(engine, OutputConstraint(kind="json_object"), 3, max_tokens=200)
    assert not ended or isinstance(json.loads(text), dict)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine):
    """A batch with and without constrained rows: the free rows' tokens are the same."""
    regex = OutputConstraint(kind="regex", spec="[0-9]+")
    compiled = engine.compile("regex", "[0-9]+")
    free = [GenerationParams(temperature=t, seed=s) for t, s in ((0.0, 1), (0.8, 2), (1.0, 3))]
    alone, mixed = Sampler(), Sampler()
    for rid, p in enumerate(free):
        alone.add_request(rid, p, [])
        mixed.add_request(rid, p, [])
    mixed.add_request(10, GenerationParams(temperature=1.0, seed=5, constraint=regex), [],
                      engine.matcher(compiled))  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    for _ in range(12):
        logits = torch.randn(4, WIDTH, generator=rng)
        a = alone.sample([0, 1, 2], logits[:3].clone()).tokens
        m = mixed.sample([0, 10, 1, 2], logits[[0, 3, 1, 2]].clone()).tokens
        assert [m[0], m[2], m[3]] == a
        assert TEXT.get(m[1], "") in set("0123456789") or m[1] == EOS


def test_a_finished_grammar_allows_only_stop_tokens(engine):
    compiled = engine.compile("choice", "", ["ok"])
    matcher = engine.matcher(compiled)
    for t in (VOCAB["o"], VOCAB["k"], EOS):
        assert matcher.accept(t)
    assert matcher.terminated
    bitmask = engine.bitmask(1)
    matcher.fill(bitmask, 0)
    logits = torch.zeros(1, WIDTH)
    apply_token_bitmask(logits, bitmask, [0], len(VOCAB))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert not matcher.accept(VOCAB["o"])


def test_bitmask_application_matches_the_bit_layout():
    rng = np.random.default_rng(0)
    vocab, rows = 100, 5
    words = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64)).to(
        torch.int32
    )
    logits = torch.randn(rows, vocab + 7)
    before = logits.clone()
    apply_token_bitmask(logits, words, [4, 0, 2], vocab)  # the bitmask has 128 bits
    for j, row in enumerate([4, 0, 2]):
        for t in range(vocab + 7):
            bit = t < vocab and (int(words[j, t // 32]) >> (t % 32)) & 1
            expect = before[row, t] if bit else -float("inf")
            assert logits[row, t] == expect, (row, t)
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_compile_errors_name_the_problem_and_equal_constraints_share_a_grammar(engine):
    with pytest.raises(GrammarError, match="json_schema: Unsupported type"):
        engine.compile("json_schema", '{"type": "nonsense"}')
    with pytest.raises(GrammarError, match="json_schema: not valid JSON"):
        engine.compile("json_schema", "{nope")
    with pytest.raises(GrammarError, match="regex: .*parenthesis"):
        engine.compile("regex", "(ab")
    with pytest.raises(GrammarError, match="grammar: EBNF parser error"):
        engine.compile("grammar", "root ::= ")
    # Keywords xgrammar would ignore (with a log line only) are refused, with where they are.
    ignored = {"type": "string", "pattern": "^a+$", "maxLength": 3}
    with pytest.raises(GrammarError, match=r"at \$.properties.a: pattern together"):
        engine.compile("json_schema", json.dumps({"properties": {"a": ignored}}))
    with pytest.raises(GrammarError, match="multipleOf"):
        engine.compile("json_schema", '{"type": "number", "multipleOf": 0.5}')
    with pytest.raises(GrammarError, match="uniqueItems"):
        engine.compile("json_schema", '{"type": "array", "uniqueItems": true}')
    before = engine.compiled
    first = engine.compile("regex", "x+y")
    assert engine.compile("regex", "x+y") is first and engine.compiled == before + 1
    assert constraint_key("regex", "x+y") != constraint_key("regex", "x+z")


def test_a_serialized_grammar_loads_in_another_engine(engine):
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    other = GrammarEngine(tok, len(VOCAB), [EOS])  # as the runner's, in its own process
    data = engine.compile_serialized("regex", "[xy]{2}")
    loaded = other.load(constraint_key("regex", "[xy]{2}"), data)
    assert other.loaded == 1 and other.compiled == 0
    matcher = other.matcher(loaded)
    assert matcher.accept(VOCAB["x"]) and matcher.accept(VOCAB["y"]) and matcher.accept(EOS)
    assert other.load(constraint_key("regex", "[xy]{2}"), b"") is loaded  # cached by key


def test_choice_grammar_escapes_quotes_and_newlines():
    assert choice_grammar(['a"b', "c\nd"]) == 'root ::= "a\\"b" | "c\\nd"'
    with pytest.raises(GrammarError):
        choice_grammar([])


@pytest.mark.parametrize(
    "constraint, field, why",
    [
        (OutputConstraint(kind="yaml"), "constraint", "kind must be one of"),
        (OutputConstraint(kind="regex"), "constraint", "regex needs a spec"),
        (OutputConstraint(kind="choice"), "constraint", "choice needs"),
        (OutputConstraint(kind="choice", choices=["a", ""]), "constraint", "must not be empty"),
        (OutputConstraint(kind="regex", spec="a", choices=["a"]), "constraint", "only for kind"),
        (OutputConstraint(kind="regex", spec="a" * 300_000), "constraint", "at most"),
    ],
)
def test_malformed_constraints_are_refused(constraint, field, why):
    with pytest.raises(InvalidParams, match=why) as info:
        validate_params(GenerationParams(constraint=constraint))
    assert info.value.field == field


def test_a_constraint_cannot_ignore_eos():
    p = GenerationParams(constraint=OutputConstraint(kind="json_object"), ignore_eos=True)
    with pytest.raises(InvalidParams) as info:
        validate_params(p)
    assert info.value.field == "ignore_eos"
    validate_params(GenerationParams(constraint=OutputConstraint(kind="json_object")))


# ---- tool calls ------------------------------------------------------------------------------

TOOLS = {t.name: t for t in (WEATHER, TIME)}


def tool_engine() -> tuple[GrammarEngine, dict[int, str]]:
    vocab = {"<pad>": 0, "<eos>": 1}
    for c in string.printable:
        if c not in "\t\r\x0b\x0c":
            vocab[c] = len(vocab)
    for piece in ("<tool_call>", "</tool_call>", '"name": "', '"arguments": '):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return GrammarEngine(tok, len(vocab), [1]), {i: t for t, i in vocab.items()}


@pytest.mark.parametrize("mode", ["required", "named", "required_single", "auto"])
def test_each_mode_constrains_calls_to_valid_ones(mode):
    engine, text_of = tool_engine()
    trigger = next(i for i, t in text_of.items() if t == "<tool_call>")
    tools = [TIME] if mode == "named" else [WEATHER, TIME]
    spec = tool_constraint(mode.removesuffix("_single"), tools, parallel=mode != "required_single")
    constraint = OutputConstraint(kind="structural_tag", spec=spec)
    compiled = engine.compile(constraint.kind, constraint.spec)
    for seed in range(8):
        sampler = Sampler()
        params = GenerationParams(temperature=1.0, seed=seed, constraint=constraint)
        sampler.add_request(1, params, [], engine.matcher(compiled))
        rng = torch.Generator().manual_seed(seed)
        out = []
        for step in range(400):
            logits = torch.randn(1, len(text_of), generator=rng) * 2
            if mode == "auto" and step == 2:
                logits[0, trigger] += 20  # free text, then a call
            token = sampler.sample([1], logits).tokens[0]
            if token == 1:
                break
            out.append(text_of[token])
        else:
            continue  # free text ran long (auto): nothing to check about its calls
        content, calls = parse_tool_calls("".join(out))
        assert calls, "".join(out)
        if mode != "auto":
            assert content is None, "".join(out)
        if mode in ("named", "required_single"):
            assert len(calls) == 1
        for call in calls:
            assert call.name in {t.name for t in tools}
            jsonschema.validate(json.loads(call.arguments), TOOLS[call.name].parameters)


@pytest.mark.model
def test_the_grammar_benchmark_runs_on_a_tiny_workload():
    from actors.bench.grammar import run

    result = run([1, 2], reps=2, with_llguidance=False)
    assert result["vocab"] == 262144 and result["tokenizer_prep_ms"] > 0
    assert set(result["compile_ms"]) == {"json_schema", "regex", "json_object"}
    assert [(r["state"], r["batch"]) for r in result["per_step"]] == [
        ("in a string", 1),
        ("in a string", 2),
        ("between fields", 1),
        ("between fields", 2),
    ]
    for r in result["per_step"]:
        assert r["allowed_per_row"] > 0 and r["sampler_constrained_ms"] > 0
    json.dumps(result)  # what --json writes


def test_property_names_are_not_read_as_keywords(engine):
    schema = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "maxLength": 3},
            "maxLength": {"type": "integer"},
            "multipleOf": {"type": "number"},
        },
        "required": ["pattern"],
    }
    engine.compile("json_schema", json.dumps(schema))  # no keyword is misread


@pytest.mark.model
def test_special_tokens_never_match_text():
    """Gemma's special tokens (turn markers, BOS, pad) are refused inside a JSON string (the
    detokenizer would drop them, so the text would not be what the grammar matched); EOS
    still ends a finished grammar."""
    from kernels.tokenizer_loader import load_tokenizer

    bundle = load_tokenizer(None)
    engine = GrammarEngine(bundle.tokenizer, bundle.vocab_size, bundle.eos_ids)
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}'
    matcher = engine.matcher(engine.compile("json_schema", schema))
    for t in bundle.encode('{"a": "hel', add_special_tokens=False):
        assert matcher.accept(t)
    bitmask = engine.bitmask(1)
    matcher.fill(bitmask, 0)
    words = bitmask[0].numpy().view(np.uint32)

    def allowed(t: int) -> bool:
        return bool((int(words[t // 32]) >> (t % 32)) & 1)

    tok = bundle.tokenizer
    for name in ("<start_of_turn>", "<end_of_turn>", "<bos>", "<pad>"):
        assert not allowed(tok.token_to_id(name)), name
    assert allowed(bundle.encode("lo", add_special_tokens=False)[0])
    for t in bundle.encode('lo"}', add_special_tokens=False):
        assert matcher.accept(t)
    matcher.fill(bitmask, 0)
    words = bitmask[0].numpy().view(np.uint32)
    assert all(allowed(t) for t in bundle.eos_ids)
