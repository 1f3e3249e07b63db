"""Hermes (NousResearch; Qwen 2.5 and Qwen 3 use it natively): each call is a JSON object in
tags, calls one after another::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Constraint: the name is one of the tools' and the arguments are valid against its schema.
History: tool results go back as `<tool_response>` blocks in user turns.
"""

from __future__ import annotations

import json
import re
from typing import Any

from actors.tool_calls.common import (
    Tool,
    ToolCall,
    ToolFormat,
    arguments_text,
    json_call,
    json_content,
    per_call_tags,
)

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

NAME_THEN_ARGUMENTS = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def format_call(name: str, arguments: Any) -> str:
    """One call in Hermes' format (`arguments`: a dict or its JSON text)."""
    args = arguments_text(arguments)
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{CALL_END}'


def parse_json_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return json_call(obj)


def cut_short_json_call(body: str) -> ToolCall | None:
    """The call an unfinished `{"name": ..., "arguments": ...` began, when its name is whole:
    the arguments are the text that followed, as far as it came (not valid JSON)."""
    found = NAME_THEN_ARGUMENTS.match(body)
    if found is None:
        return None
    return ToolCall(name=json.loads(found.group(1)), arguments=body[found.end() :].rstrip())


class Hermes(ToolFormat):
    name = "hermes"
    begins = (CALL_BEGIN,)

    def close(self, begin: str, body: str, tools: dict[str, Tool]):
        """A block ends at the first `</tool_call>` before which it parses (the tag may also
        appear inside an argument string); one that does not open with `{` is not a call and
        ends at the first tag."""
        start = 0
        while (end := body.find(CALL_END, start)) >= 0:
            inner = body[:end]
            if not inner.lstrip().startswith("{"):
                return end + len(CALL_END), None
            call = parse_json_call(inner)
            if call is not None:
                return end + len(CALL_END), [call]
            start = end + 1
        return None

    def cut_short(self, begin: str, body: str, tools: dict[str, Tool]) -> list[ToolCall]:
        call = cut_short_json_call(body)
        return [call] if call else []

    def constraint(self, mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
        """Calls alone (`required`, `named`) or text until `<tool_call>` (`auto`); the name is
        a tool's and the arguments are valid against its schema."""
        tags = [
            {
                "type": "tag",
                "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(t.name)}, "arguments": ',
                "content": json_content(t.parameters),
                "end": f"}}\n{CALL_END}",
            }
            for t in tools
        ]
        return per_call_tags(mode, tags, CALL_BEGIN, "\n", parallel)

    def detect(self, template: str) -> bool:
        return CALL_BEGIN in template

    def write_calls(self, calls) -> str:
        return "\n".join(format_call(name, args) for name, args in calls)

    def write_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def preamble(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
