"""Every tool-call format, pure: recorded model outputs parsed whole and streamed split at
every character, calls cut short by max_tokens, the history each writes for a template
without tools, `auto`'s choice from a template, and the shape of each mode's constraint.
The constraints are compiled and sampled in tests/model/test_tool_format_grammars.py."""

from __future__ import annotations

import json

import pytest

from actors.app.config import ConfigError, EngineConfig
from actors.app.specs import tool_call_format
from actors.tool_calls import FORMATS, Tool, resolve_tool_format, tool_format
from tests.unit.tool_specs import TIME, WEATHER

CODE = Tool(
    name="run_code",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["code"],
    },
)
TOOLS = [WEATHER, TIME, CODE]

W = ("get_weather", {"city": "Paris", "days": 2})
T_UTC = ("get_time", {"zone": "UTC"})
T_CET = ("get_time", {"zone": "CET"})

# (format, model output, content, calls): outputs as the models write them.
RECORDED = [
    # Qwen 2.5 / Qwen 3
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
        "</tool_call>",
        None,
        [W, T_UTC],
    ),
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    # Llama 3.1 / 3.2 / 3.3
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        None,
        [W],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
        None,
        [T_UTC, W],
    ),
    (
        "llama3_json",
        'Checking.\n{"name": "run_code", "parameters": {"code": "print(\'}{\')"}}',
        "Checking.",
        [("run_code", {"code": "print('}{')"})],
    ),
    (
        "llama3_json",
        'JSON like {"sunny": true} or {"name": 3} is text; so is this;',
        'JSON like {"sunny": true} or {"name": 3} is text; so is this;',
        [],
    ),
    # Mistral 7B v0.3 / Nemo (array) and v11+ tokenizers (one [TOOL_CALLS] per call)
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        None,
        [W, T_UTC],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        None,
        [W, T_CET],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Sure.",
        [T_CET],
    ),
    ("mistral", "[TOOL_CALLS] not json [1, 2]", "[TOOL_CALLS] not json [1, 2]", []),
    # Llama 3.2 / Llama 4 pythonic
    (
        "pythonic",
        "[get_weather(city='Paris', days=2), get_time(zone=\"UTC\")]",
        None,
        [W, T_UTC],
    ),
    (
        "pythonic",
        "<|python_start|>[get_time(zone='CET')]<|python_end|>",
        None,
        [T_CET],
    ),
    (
        "pythonic",
        "I'll run it. [run_code(code='x = [1, (2)]\\nprint(\"]\")', timeout=-3)]",
        "I'll run it.",
        [("run_code", {"code": 'x = [1, (2)]\nprint("]")', "timeout": -3})],
    ),
    (
        "pythonic",
        '[f(a=True, b=None, c=[1, 2.5], d={"k": false}, e=null)]',
        None,
        [("f", {"a": True, "b": None, "c": [1, 2.5], "d": {"k": False}, "e": None})],
    ),
    (
        "pythonic",
        "See [1], [link](x) and [print('hi')] or [f(x=open())].",
        "See [1], [link](x) and [print('hi')] or [f(x=open())].",
        [],
    ),
    # Qwen3-Coder
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
        None,
        [W, T_UTC],
    ),
    (
        "qwen3_coder",
        "Let me run it.\n<tool_call>\n<function=run_code>\n<parameter=code>\n"
        "def f():\n    return 1\n\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
        "</function>\n</tool_call>",
        "Let me run it.",
        [("run_code", {"code": "def f():\n    return 1\n", "timeout": 30})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=run_code>\n<parameter=code>\n123\n</parameter>\n</function>\n"
        "</tool_call>",
        None,
        [("run_code", {"code": "123"})],  # a string, as its schema says
    ),
    (
        "qwen3_coder",
        "<tool_call>\nnot a function\n</tool_call> after",
        "<tool_call>\nnot a function\n</tool_call> after",
        [],
    ),
]


def whole(fmt: str, text: str, calls_only: bool = False):
    content, calls = tool_format(fmt).parse(text, calls_only, TOOLS)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(fmt: str, pieces: list[str], calls_only: bool = False):
    parser = tool_format(fmt).parser(calls_only, TOOLS)
    content, calls = [], []
    for piece in pieces:
        c, new = parser.feed(piece)
        content.append(c)
        calls += new
    tail, cut = parser.finish()
    assert parser.calls == calls + cut
    return "".join(content) + tail, [(c.name, c.arguments) for c in calls + cut]


def assert_streams_as_whole(fmt: str, text: str, calls_only: bool = False) -> None:
    content, calls = whole(fmt, text, calls_only)
    expected = (content or "", calls)
    assert streamed(fmt, list(text), calls_only) == expected, "one character at a time"
    for at in range(len(text) + 1):
        assert streamed(fmt, [text[:at], text[at:]], calls_only) == expected, at


@pytest.mark.parametrize("fmt, text, content, calls", RECORDED)
def test_recorded_outputs_parse_whole_and_split_at_every_character(fmt, text, content, calls):
    got_content, got_calls = whole(fmt, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls
    assert_streams_as_whole(fmt, text)
    assert_streams_as_whole(fmt, text, calls_only=True)


# (format, output cut short by max_tokens, the calls it gives: complete ones, then the open
# one with its arguments as far as they came)
CUT_SHORT = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
        [("get_weather", '{"city": "Os')],
    ),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", '
        '"parameters": {"city": "Os',
        [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Os')],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": '
        '"get_weather", "arguments": {"city": "Os',
        [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Os')],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Os', [("get_weather", '{"city": "Os')]),
    (
        "pythonic",
        "[get_time(zone='UTC'), get_weather(city='Oslo', da",
        [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"')],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<param",
        [("get_weather", '{"city": "Oslo"')],
    ),
]


@pytest.mark.parametrize("fmt, text, calls", CUT_SHORT)
def test_a_call_cut_short_is_a_call_not_markup(fmt, text, calls):
    for calls_only in (False, True):
        assert whole(fmt, "Checking. " + text, calls_only) == ("Checking.", calls)
        assert whole(fmt, text, calls_only) == (None, calls)
        assert_streams_as_whole(fmt, "Checking. " + text, calls_only)


@pytest.mark.parametrize(
    "fmt, before_the_name",
    [
        ("hermes", '<tool_call>\n{"name": "get_wea'),
        ("llama3_json", '{"name": "get_wea'),
        ("mistral", '[TOOL_CALLS] [{"name": "get_wea'),
        ("pythonic", "[get_wea"),
        ("qwen3_coder", "<tool_call>\n<function=get_wea"),
    ],
)
def test_a_block_cut_short_before_its_name_is_text_or_nothing(fmt, before_the_name):
    assert whole(fmt, before_the_name) == (before_the_name, [])  # free text: as written
    assert whole(fmt, before_the_name, calls_only=True) == (None, [])
    assert whole(fmt, before_the_name[:3], calls_only=True) == (None, [])


def test_qwen3_coder_values_follow_the_schema_when_the_tools_are_known():
    text = (
        "<tool_call>\n<function=run_code>\n<parameter=code>\n123\n</parameter>\n"
        "<parameter=timeout> 5 </parameter>\n</function>\n</tool_call>"
    )
    fmt = tool_format("qwen3_coder")
    assert json.loads(fmt.parse(text, tools=[CODE])[1][0].arguments) == {
        "code": "123",
        "timeout": 5,
    }
    # Without the schemas a value reads as JSON where it can.
    assert json.loads(fmt.parse(text)[1][0].arguments) == {"code": 123, "timeout": 5}
    enum = "<tool_call>\n<function=get_time>\n<parameter=zone> CET </parameter>\n</function>\n"
    assert fmt.parse(enum + "</tool_call>", tools=[TIME])[1][0].arguments == '{"zone": "CET"}'


# ---- history and preamble --------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": {"zone": "UTC"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_history_is_written_in_the_format_and_parses_back(fmt):
    """A template without tools gets the calls in the model's own syntax (which this format's
    parser reads back as the same calls), results as one user turn, tools in the system."""
    tools = [WEATHER.openai(), TIME.openai()]
    messages, extra = tool_format(fmt).prompt_messages(HISTORY, tools, native=False)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "get_weather" in messages[0]["content"] and "Paris" in messages[0]["content"]
    content, calls = tool_format(fmt).parse(messages[2]["content"], tools=TOOLS)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [W, T_UTC]
    results = messages[3]["content"]
    assert (
        "sunny" in results
        and "12:00" in results
        and results.index("sunny") < results.index("12:00")
    )
    native, extra = tool_format(fmt).prompt_messages(HISTORY, tools, native=True)
    assert extra == {"tools": tools}
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}


def test_preambles_describe_each_format():
    tools = [TIME.openai()]
    marks = {
        "hermes": "<tool_call>",
        "llama3_json": '"parameters"',
        "mistral": "[TOOL_CALLS]",
        "pythonic": "[func_name1(",
        "qwen3_coder": "<function=",
    }
    for name, mark in marks.items():
        (system, _), _ = tool_format(name).prompt_messages(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            tools,
            native=False,
        )
        assert system["content"].startswith("Be brief.\n\n"), name
        assert mark in system["content"] and "get_time" in system["content"], name


# ---- choosing the format ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for tool in tools %}<tool_call>{{ tool | tojson }}{% endfor %}", "hermes"),
        ("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>", "qwen3_coder"),
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3_json"),
        ("[func_name1(params_name1=params_value1)] ipython", "pythonic"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_auto_picks_the_format_the_template_shows(template, expected):
    assert resolve_tool_format("auto", template) == expected


def test_a_named_format_is_kept_and_an_unknown_one_is_refused():
    assert resolve_tool_format("pythonic", "<tool_call>") == "pythonic"
    with pytest.raises(ValueError, match="known: auto, hermes, llama3_json, mistral"):
        tool_format("gorilla")
    assert tool_format("auto").name == "hermes"  # no template to go by


def test_the_server_resolves_its_format_once_from_the_config(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}[TOOL_CALLS]{{ tools }}")
    cfg = EngineConfig.load(server__chat_template=str(template))
    assert tool_call_format(cfg) == "mistral"
    cfg = EngineConfig.load(server__tool_call_parser="pythonic")
    assert tool_call_format(cfg) == "pythonic"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "<tool_call>\n<function=x>\n<parameter=y>"})
    )
    assert tool_call_format(EngineConfig.load(model__path=str(folder))) == "qwen3_coder"
    with pytest.raises(ConfigError, match="server.tool_call_parser: unknown tool-call format"):
        tool_call_format(EngineConfig.load(server__tool_call_parser="gorilla"))


# ---- the constraints' shape ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_mode_makes_its_structural_tag(fmt):
    f = tool_format(fmt)
    assert f.constraint("none", TOOLS) is None
    auto = json.loads(f.constraint("auto", TOOLS))
    assert auto["type"] == "structural_tag"
    assert auto["format"]["type"] == "triggered_tags"
    for trigger in auto["format"]["triggers"]:
        assert any(t["begin"].startswith(trigger) for t in auto["format"]["tags"])
    named = f.constraint("named", [TIME])
    assert "get_time" in named and "get_weather" not in named
    required = json.loads(f.constraint("required", TOOLS))["format"]
    assert required["type"] != "triggered_tags"  # calls alone: no free text
    text = json.dumps(required)
    assert all(t.name in text for t in TOOLS)
    assert f.constraint("required", TOOLS, parallel=False) != f.constraint("required", TOOLS)
