"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (vLLM's `llama3_json`): a bare JSON object per call,
several separated by `; `, after an optional `<|python_tag|>`::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A call begins at `{"name"` wherever it appears (as xgrammar's trigger does) and ends where
its object closes; `"arguments"` is read as well as `"parameters"`. `<|python_tag|>` is
dropped. Constraint: the name is a tool's and the parameters are valid against its schema.
History: calls as above; tool results go back as user turns (Meta's templates use the
`ipython` role, which a template without tools does not know).
"""

from __future__ import annotations

import json
from typing import Any

from actors.tool_calls.common import (
    Tool,
    ToolCall,
    ToolFormat,
    arguments_text,
    balanced_end,
    json_call,
    json_content,
    per_call_tags,
)
from actors.tool_calls.hermes import cut_short_json_call

CALL_BEGIN = '{"name"'
PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "

TOOLS_PREAMBLE = (
    "You have access to the following functions. To call a function, respond with a JSON "
    'object of the form {{"name": function name, "parameters": dictionary of argument name '
    "and its value}}, and nothing else; separate several calls with '; '. Do not use "
    "variables.\n\n{tools}"
)


def format_call(name: str, arguments: Any) -> str:
    return f'{{"name": {json.dumps(name)}, "parameters": {arguments_text(arguments)}}}'


class Llama3Json(ToolFormat):
    name = "llama3_json"
    begins = (CALL_BEGIN, PYTHON_TAG)
    blanks = " \t\r\n;"
    special_markers = True  # <|python_tag|>

    def close(self, begin: str, body: str, tools: dict[str, Tool]):
        if begin == PYTHON_TAG:
            return 0, []  # a marker, not text
        end = balanced_end(body, depth=1)
        if end is None:
            return None
        try:
            obj = json.loads(CALL_BEGIN + body[:end])
        except json.JSONDecodeError:
            return end, None
        call = json_call(obj, keys=("parameters", "arguments"))
        return end, (None if call is None else [call])

    def cut_short(self, begin: str, body: str, tools: dict[str, Tool]) -> list[ToolCall]:
        call = cut_short_json_call(CALL_BEGIN + body) if begin == CALL_BEGIN else None
        return [call] if call else []

    def constraint(self, mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
        """Calls alone (`required`, `named`) or text until `{"name": ` (`auto`); the name is
        a tool's and the parameters are valid against its schema."""
        tags = [
            {
                "type": "tag",
                "begin": f'{{"name": {json.dumps(t.name)}, "parameters": ',
                "content": json_content(t.parameters),
                "end": "}",
            }
            for t in tools
        ]
        return per_call_tags(mode, tags, '{"name": ', SEPARATOR, parallel)

    def detect(self, template: str) -> bool:
        return PYTHON_TAG in template or "ipython" in template

    def write_calls(self, calls) -> str:
        return SEPARATOR.join(format_call(name, args) for name, args in calls)

    def preamble(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_PREAMBLE.format(tools="\n\n".join(json.dumps(t, indent=4) for t in tools))
