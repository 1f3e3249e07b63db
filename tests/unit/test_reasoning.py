"""The reasoning parsers (`actors.reasoning`) on outputs as DeepSeek-R1 and Qwen3 write them:
whole, streamed one character at a time, and split in two at every character (and in
three at every pair of characters for the shorter ones), which must all give the same
(reasoning, content); the prompt's tail deciding where the output starts; the constraint
wrapped so reasoning comes first (its shape here; that it compiles and matches the right
strings is tests/model/test_reasoning_grammar.py's)."""

from __future__ import annotations

import json
import random

import pytest

from actors.reasoning import (
    GAP_PATTERN,
    REASONING_PARSERS,
    ReasoningConstraintError,
    check_reasoning_parser,
    prompt_state,
    reasoning_format,
    wrap_constraint,
)
from transport.messages.params import OutputConstraint

# Prompt tails (the decoded last tokens of a rendered prompt, special tokens kept)
R1_OPEN = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"  # R1's current template
R1_BARE = "<｜User｜>What is 2+2?<｜Assistant｜>"  # R1's first template: no tag
V31_OFF = "<｜User｜>What is 2+2?<｜Assistant｜></think>"  # DeepSeek-V3.1, thinking off
QWEN = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN_OPEN = QWEN + "<think>\n"  # Qwen3 2507 thinking templates
QWEN_OFF = QWEN + "<think>\n\n</think>\n\n"  # Qwen3, enable_thinking=False

R1_THOUGHT = (
    "Okay, the user asks what 2+2 is. That's simple arithmetic: 2 plus 2 equals 4.\n\n"
    "Let me double-check: 2+2 = 4. Yes.\n"
)

# (parser, prompt tail, output, expected reasoning, expected content)
RECORDED = [
    # DeepSeek-R1: the template opened <think>; the model writes only </think>
    (
        "deepseek_r1",
        R1_OPEN,
        R1_THOUGHT + "</think>\n\n2 + 2 = **4**.",
        R1_THOUGHT.strip(),
        "2 + 2 = **4**.",
    ),
    # ... or repeats the opening tag
    (
        "deepseek_r1",
        R1_OPEN,
        "<think>\n" + R1_THOUGHT + "</think>\n\nThe answer is 4.",
        R1_THOUGHT.strip(),
        "The answer is 4.",
    ),
    # the first template did not open it: text before </think> is still reasoning (vLLM)
    ("deepseek_r1", R1_BARE, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),
    ("deepseek_r1", R1_BARE, "<think>\nHmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),
    # cut short by max_tokens inside reasoning: reasoning only
    (
        "deepseek_r1",
        R1_OPEN,
        "Okay, let me think about this carefully. First,",
        "Okay, let me think about this carefully. First,",
        "",
    ),
    ("deepseek_r1", R1_OPEN, "The tag is </thi", "The tag is </thi", ""),
    ("deepseek_r1", R1_OPEN, "<thi", "<thi", ""),
    ("deepseek_r1", R1_OPEN, "", "", ""),
    # an empty reasoning, and tags in the answer are the answer's text
    ("deepseek_r1", R1_OPEN, "</think>\n\n42", "", "42"),
    ("deepseek_r1", R1_OPEN, "\n\n</think>\n\n", "", ""),
    (
        "deepseek_r1",
        R1_OPEN,
        "x</think>\n\nWrite <think> and </think>, then stop.\n",
        "x",
        "Write <think> and </think>, then stop.\n",
    ),
    (
        "deepseek_r1",
        R1_OPEN,
        "a <think> inside\n\n stays</think>b",
        "a <think> inside\n\n stays",
        "b",
    ),
    # thinking turned off by the template: content from the start, as written
    ("deepseek_r1", V31_OFF, "\n2 + 2 = 4.", "", "\n2 + 2 = 4."),
    ("deepseek_r1", V31_OFF, "<think>\nbrief\n</think>\n\n4", "brief", "4"),
    # Qwen3's own template: the model writes the whole block
    (
        "qwen3",
        QWEN,
        "<think>\nOkay, 2+2 is 4.\n</think>\n\n2 + 2 = 4.",
        "Okay, 2+2 is 4.",
        "2 + 2 = 4.",
    ),
    ("qwen3", QWEN, "<think>\n\n</think>\n\nHello!", "", "Hello!"),
    (
        "qwen3",
        QWEN,
        "<think>\n考虑一下 🤔 2+2……\n</think>\n\n答案是 4。",
        "考虑一下 🤔 2+2……",
        "答案是 4。",
    ),
    (
        "qwen3",
        QWEN,
        "<think>\nstill thinking when max_tokens hit",
        "still thinking when max_tokens hit",
        "",
    ),
    # no block: all content, whatever it holds
    ("qwen3", QWEN, "2 + 2 = 4.", "", "2 + 2 = 4."),
    (
        "qwen3",
        QWEN,
        "\n\nI think </think> closes a block.",
        "",
        "\n\nI think </think> closes a block.",
    ),
    (
        "qwen3",
        QWEN,
        "<thinking>is not the tag</thinking>",
        "",
        "<thinking>is not the tag</thinking>",
    ),
    ("qwen3", QWEN, "<html><body/></html>", "", "<html><body/></html>"),
    ("qwen3", QWEN, "<thin", "", "<thin"),
    (
        "qwen3",
        QWEN,
        "Answer first. <think>not a block</think>",
        "",
        "Answer first. <think>not a block</think>",
    ),
    # the 2507 thinking templates open it in the prompt
    ("qwen3", QWEN_OPEN, "Let me see: 4.\n</think>\n\n4", "Let me see: 4.", "4"),
    ("qwen3", QWEN_OPEN, "Let me", "Let me", ""),
    # enable_thinking=False: the prompt holds an empty, closed block
    ("qwen3", QWEN_OFF, "2 + 2 = 4.", "", "2 + 2 = 4."),
    ("think", QWEN, "<think>a</think>b", "a", "b"),
    ("deepseek_v3", V31_OFF, "4", "", "4"),
    ("deepseek_v3", R1_OPEN, "r</think>c", "r", "c"),
    ("deepseek_v3", R1_BARE, "r</think>c", "", "r</think>c"),  # V3-0324: no thinking
]


def _stream(parser: str, tail: str, chunks: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = reasoning_format(parser).splitter(tail)
    pieces = [splitter.feed(c) for c in chunks] + [splitter.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces), pieces


def _ids(case):
    return f"{case[0]}:{case[2][:24]!r}"


@pytest.mark.parametrize("case", RECORDED, ids=[_ids(c) for c in RECORDED])
def test_whole_and_streamed_splits_agree(case):
    parser, tail, text, reasoning, content = case
    fmt = reasoning_format(parser)
    assert fmt.split(text, tail) == (reasoning, content)
    # one character at a time
    r, c, pieces = _stream(parser, tail, list(text))
    assert (r, c) == (reasoning, content)
    for part_r, part_c in pieces:  # tags never leak into a delta
        assert "</think>" not in part_r or "</think>" in reasoning
    # in two at every character
    for i in range(len(text) + 1):
        assert _stream(parser, tail, [text[:i], text[i:]])[:2] == (reasoning, content), i
    # in three at every pair (short outputs), with empty chunks too
    if len(text) <= 60:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                got = _stream(parser, tail, [text[:i], "", text[i:j], text[j:]])[:2]
                assert got == (reasoning, content), (i, j)


def test_random_chunkings_of_long_outputs():
    rng = random.Random(0)
    for parser, tail, text, reasoning, content in RECORDED:
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 6)))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert _stream(parser, tail, chunks)[:2] == (reasoning, content)


def test_streaming_holds_back_only_what_may_be_a_tag_or_dropped_whitespace():
    s = reasoning_format("qwen3").splitter(QWEN)
    assert s.feed("<thi") == ("", "") and not s.in_reasoning
    assert s.feed("nk>\nOkay") == ("Okay", "") and s.in_reasoning
    assert s.feed(", so\n") == (", so", "")  # the newline may precede </think>
    assert s.feed("four.</") == ("\nfour.", "")  # a partial close tag is held
    assert s.feed("think>\n\n") == ("", "") and not s.in_reasoning and s.reasoning_ended
    assert s.feed("4") == ("", "4")
    assert s.feed(" </think> <think>") == ("", " </think> <think>")
    assert s.finish() == ("", "")
    assert s.finish() == ("", "")
    with pytest.raises(RuntimeError):
        s.feed("more")

    r1 = reasoning_format("deepseek_r1").splitter(R1_OPEN)
    assert r1.in_reasoning
    assert r1.feed("Sure") == ("Sure", "")  # not a beginning of <think>: reasoning at once
    assert r1.feed("</think>") == ("", "") and r1.reasoning_ended

    plain = reasoning_format("qwen3").splitter(QWEN)
    assert plain.feed("Hello") == ("", "Hello")  # not a beginning of <think>: content at once
    assert plain.feed("<think>") == ("", "<think>")


def test_prompt_state_and_where_output_starts():
    assert prompt_state(R1_OPEN) == "open" and prompt_state(QWEN_OPEN) == "open"
    assert prompt_state(QWEN_OFF) == "closed" and prompt_state(V31_OFF) == "closed"
    assert prompt_state(QWEN) == "none" and prompt_state("") == "none"
    r1, qwen = reasoning_format("deepseek_r1"), reasoning_format("qwen3")
    assert r1.starts_in_reasoning(R1_OPEN) and r1.starts_in_reasoning(R1_BARE)
    assert not r1.starts_in_reasoning(V31_OFF)
    assert qwen.starts_in_reasoning(QWEN_OPEN)
    assert not qwen.starts_in_reasoning(QWEN) and not qwen.starts_in_reasoning(QWEN_OFF)
    # a closed block earlier in the tail, then an open one: open
    assert prompt_state("</think>\n\nok<|im_start|>assistant\n<think>\n") == "open"


def test_names():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3", "think"}
    assert check_reasoning_parser("") == "" and check_reasoning_parser("  ") == ""
    assert check_reasoning_parser("deepseek_r1") == "deepseek_r1"
    assert check_reasoning_parser("DeepSeek-R1") == "deepseek_r1"  # SGLang's spelling
    assert reasoning_format("Qwen3").name == "qwen3"
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'.*deepseek_r1.*qwen3"):
        check_reasoning_parser("granite")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format("")


# ---- wrap_constraint ---------------------------------------------------------------------

R1 = reasoning_format("deepseek_r1")
QWEN3 = reasoning_format("qwen3")


def _format(c: OutputConstraint) -> dict:
    assert c.kind == "structural_tag"
    tag = json.loads(c.spec)
    assert tag["type"] == "structural_tag"
    return tag["format"]


def test_wrapping_puts_free_text_up_to_the_close_tag_first():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    orig = OutputConstraint(kind="json_schema", spec=json.dumps(schema))
    inner = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
    gap = {"type": "regex", "pattern": GAP_PATTERN}
    # start unknown: reasoning then the answer, or the answer alone
    assert _format(wrap_constraint(R1, orig)) == {
        "type": "or",
        "elements": [{"type": "sequence", "elements": [thinking, gap, inner]}, inner],
    }
    # known to start in reasoning: it must end before the answer
    assert _format(wrap_constraint(R1, orig, R1_OPEN)) == {
        "type": "sequence",
        "elements": [thinking, gap, inner],
    }
    assert _format(wrap_constraint(QWEN3, orig, QWEN_OPEN))["type"] == "sequence"
    # known not to (no tag in the prompt): a <think> block first, or the answer alone
    block = dict(thinking, begin="<think>")
    assert _format(wrap_constraint(QWEN3, orig, QWEN)) == {
        "type": "or",
        "elements": [{"type": "sequence", "elements": [block, gap, inner]}, inner],
    }
    # the template closed it (thinking disabled): the answer at once
    for fmt, tail in ((QWEN3, QWEN_OFF), (R1, V31_OFF)):
        assert wrap_constraint(fmt, orig, tail) is orig


def test_every_kind_wraps_as_a_structural_tag_format():
    def inner(c):
        return _format(wrap_constraint(R1, c, R1_OPEN))["elements"][2]

    assert inner(OutputConstraint(kind="json_object")) == {
        "type": "json_schema",
        "json_schema": {"type": "object"},
        "max_whitespace_cnt": 1,
    }
    assert inner(OutputConstraint(kind="regex", spec="[0-9]+")) == {
        "type": "regex",
        "pattern": "[0-9]+",
    }
    assert inner(OutputConstraint(kind="choice", choices=["yes", 'say "no"', ""])) == {
        "type": "grammar",
        "grammar": 'root ::= "yes" | "say \\"no\\"" | ""',
    }
    ebnf = 'root ::= "a" b\nb ::= "x"'
    assert inner(OutputConstraint(kind="grammar", spec=ebnf)) == {
        "type": "grammar",
        "grammar": ebnf,
    }
    calls = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": []}
    tag = OutputConstraint(
        kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": calls})
    )
    assert inner(tag) == calls


def test_what_is_left_as_is_and_what_is_refused():
    assert wrap_constraint(R1, None) is None
    regex = OutputConstraint(kind="regex", spec="(yes|no)")
    assert wrap_constraint(None, regex) is regex  # no reasoning parser
    # a constraint spelling out the close tag shapes the reasoning itself
    shaped = OutputConstraint(kind="regex", spec="<think>[a-z ]{1,20}</think>\n\n(yes|no)")
    assert wrap_constraint(QWEN3, shaped) is shaped
    choice = OutputConstraint(kind="choice", choices=["a</think>b"])
    assert wrap_constraint(R1, choice) is choice
    # but not a schema merely mentioning it
    schema = OutputConstraint(kind="json_schema", spec='{"description": "no </think>"}')
    assert wrap_constraint(R1, schema).kind == "structural_tag"
    legacy = {"type": "structural_tag", "structures": [], "triggers": ["<f>"]}
    bad = [
        (OutputConstraint(kind="structural_tag", spec=json.dumps(legacy)), "structural_tag: only"),
        (OutputConstraint(kind="structural_tag", spec="{nope"), "structural_tag: not valid JSON"),
        (OutputConstraint(kind="json_schema", spec="{nope"), "json_schema: not valid JSON"),
        (OutputConstraint(kind="json_schema", spec="[1]"), "json_schema: the schema must be"),
        (OutputConstraint(kind="choice", choices=[]), "choice: give at least one"),
        (OutputConstraint(kind="nonsense"), "nonsense: not a constraint kind"),
    ]
    for c, message in bad:
        with pytest.raises(ReasoningConstraintError, match=message):
            wrap_constraint(R1, c)
    assert issubclass(ReasoningConstraintError, ValueError)


def test_a_prompt_that_closed_the_reasoning_keeps_the_constraint_as_it_is():
    """Thinking disabled by the template (an empty, closed block ends the prompt): the
    answer is constrained from its first token, for either convention."""
    orig = OutputConstraint(kind="choice", choices=["yes", "no"])
    for fmt in (R1, QWEN3):
        assert wrap_constraint(fmt, orig, prompt_tail=QWEN_OFF) is orig
        assert wrap_constraint(fmt, orig, prompt_tail=QWEN) is not orig
