"""The tool-call format, pure: parsing (whole and streamed piece by piece), the tool_choice
rules and the prompt a template with or without tools gets. The constraints each mode makes
are compiled and sampled in tests/model/test_grammar.py."""

from __future__ import annotations

import json

import pytest

from actors.tool_calls import (
    TOOLS_PREAMBLE,
    ToolCallParser,
    ToolSpecError,
    format_call,
    parse_tool_calls,
    prompt_messages,
    resolve_tool_choice,
    template_knows_tools,
    tool_constraint,
)
from tests.unit.tool_specs import TIME, WEATHER


def stream_pieces(text: str, size: int) -> tuple[str, list]:
    parser = ToolCallParser()
    content, calls = [], []
    for i in range(0, len(text), size):
        c, new = parser.feed(text[i : i + size])
        content.append(c)
        calls += new
    tail, cut = parser.finish()
    content.append(tail)
    return "".join(content), calls + cut


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text, no calls.", "Just text, no calls.", []),
        (format_call("get_time", {"zone": "UTC"}), None, [("get_time", {"zone": "UTC"})]),
        (
            "Let me check.\n"
            + format_call("get_weather", '{"city": "Oslo", "days": 2}')
            + "\n"
            + format_call("get_time", {"zone": "CET"})
            + "\n",
            "Let me check.",
            [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})],
        ),  # fmt: skip
        (
            "<tool_call>\nnot json\n</tool_call> after",
            "<tool_call>\nnot json\n</tool_call> after",
            [],
        ),
        (
            format_call("w", {"text": "ends with </tool_call> here"}),
            None,
            [("w", {"text": "ends with </tool_call> here"})],
        ),
        (
            "<tool_call>x</tool_call> then " + format_call("f", {}),
            "<tool_call>x</tool_call> then",
            [("f", {})],
        ),
        ('cut short <tool_call>\n{"name": "get_ti', 'cut short <tool_call>\n{"name": "get_ti', []),
        ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            None,
            [("f", {"x": 1})],
        ),
    ],  # fmt: skip
)
def test_parsing_whole_and_streamed_agree(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for size in (1, 3, 7, 1000):
        streamed, streamed_calls = stream_pieces(text, size)
        assert streamed == (content or "")
        assert [(c.name, c.arguments) for c in streamed_calls] == [
            (c.name, c.arguments) for c in got_calls
        ]
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_call_cut_short_after_its_name_is_a_call_not_markup(size):
    """max_tokens ending a call: OpenAI returns the call with its arguments as far as they
    came; the `<tool_call>` markup never reaches the content."""
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    for got_content, got_calls in (parse_tool_calls(text), stream_pieces(text, size)):
        assert got_content == "Checking."
        assert [(c.name, c.arguments) for c in got_calls] == [("get_weather", '{"city": "Os')]
    only = '<tool_call>\n{"name": "get_weather", "arguments": '
    content, calls = parse_tool_calls(only)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", "")]
    before_the_name = '<tool_call>\n{"name": "get_wea'
    assert parse_tool_calls(before_the_name) == (before_the_name, [])  # free text: as written
    assert parse_tool_calls(before_the_name, calls_only=True) == (None, [])
    assert parse_tool_calls("<tool_c", calls_only=True) == (None, [])


def test_tool_choice_rules():
    tools = [WEATHER, TIME]
    assert resolve_tool_choice(tools, None) == ("auto", tools)
    assert resolve_tool_choice(tools, "none") == ("none", [])
    assert resolve_tool_choice(tools, "required") == ("required", tools)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_tool_choice(tools, named) == ("named", [TIME])
    assert resolve_tool_choice([], None) == ("none", [])
    for bad, why in [
        ({"type": "function", "function": {"name": "nope"}}, "no tool named 'nope'"),
        ({"type": "function"}, "expected"),
        ("sometimes", "expected"),
    ]:
        with pytest.raises(ToolSpecError, match=why):
            resolve_tool_choice(tools, bad)
    with pytest.raises(ToolSpecError, match="tool_choice: given without tools"):
        resolve_tool_choice([], "required")
    with pytest.raises(ToolSpecError, match="unique"):
        resolve_tool_choice([TIME, TIME], None)
    assert tool_constraint("none", tools) is None


def test_a_template_without_tools_gets_them_in_the_system_turn():
    tools = [WEATHER.openai()]
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
    ]
    messages, extra = prompt_messages(history, tools, native=False)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert json.dumps(tools[0]) in messages[0]["content"]
    assert messages[2]["content"] == format_call("get_weather", '{"city": "Oslo", "days": 1}')
    assert messages[3]["content"] == (
        '<tool_response>\n{"temp": -3}\n</tool_response>\n<tool_response>\nwindy\n</tool_response>'
    )
    only_user, _ = prompt_messages([{"role": "user", "content": "hi"}], tools, native=False)
    assert only_user[0] == {
        "role": "system",
        "content": TOOLS_PREAMBLE.format(tools=json.dumps(tools[0])),
    }


def test_a_template_with_tools_gets_them_natively():
    assert template_knows_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_knows_tools("{{ messages }}") and not template_knows_tools(None)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    history = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    messages, extra = prompt_messages(history, [WEATHER.openai()], native=True)
    assert extra == {"tools": [WEATHER.openai()]}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert history[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not edited
