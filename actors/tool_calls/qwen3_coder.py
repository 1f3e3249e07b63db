"""Qwen3-Coder XML calls (vLLM's `qwen3_coder`): each parameter's value as text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A value loses one newline at each end and is read by its parameter's schema when the parser
knows the request's tools (an enum's or const's member, blanks around it allowed; string: as
written; integer, number, boolean, null: their text; object, array: JSON, else a Python
literal; what does not read stays text), and as JSON, else text, when it does not. A value
cannot contain `</parameter>`.

Constraint: the name is a tool's, and the parameters follow xgrammar's `qwen_xml` style of the
tool's schema: the schema's properties, each valid against its own schema (strings as raw
text, other values as JSON). History: tool results go back as `<tool_response>` blocks.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from actors.tool_calls.common import (
    Tool,
    ToolCall,
    ToolFormat,
    as_dict,
    json_content,
    partial_object,
    per_call_tags,
)
from actors.tool_calls.hermes import CALL_BEGIN, CALL_END

FUNCTION = "<function="
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
FUNCTION_END = "</function>"

TOOLS_PREAMBLE = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
    "If you choose to call a function, reply in the following format, and nothing else:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the "
    "second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>"
)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
        f"\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"{CALL_BEGIN}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{CALL_END}"


def read_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (no schema: JSON if it reads, else text)."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        for candidate in (text, text.strip()):  # the grammar allows blanks around a value
            if candidate in values:
                return candidate
            if (value := _json_or_text(candidate)) in values and not isinstance(value, str):
                return value
    kinds = schema.get("type") if isinstance(schema, dict) else None
    if kinds is None:
        return _json_or_text(text)
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in sorted(kinds, key=lambda k: k == "string"):  # text last: it always reads
        if kind == "string":
            return text
        try:
            value = _typed(text.strip(), kind)
        except ValueError:
            continue
        return value
    return text


def _typed(text: str, kind: str) -> Any:
    if kind == "integer":
        return int(text)
    if kind == "number":
        value = float(text)
        return int(value) if value.is_integer() and "." not in text and "e" not in text else value
    if kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError(text)
    if kind == "null":
        if text.lower() in ("null", "none"):
            return None
        raise ValueError(text)
    if kind in ("object", "array"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                raise ValueError(text) from None
        if isinstance(value, dict if kind == "object" else (list, tuple)):
            return list(value) if isinstance(value, tuple) else value
        raise ValueError(text)
    raise ValueError(kind)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def read_function(body: str, tools: dict[str, Tool]) -> tuple[ToolCall | None, dict, bool]:
    """(the call, None if `body` is not one; the parameters read; whether the function's
    name was whole) of `<function=NAME>` + parameters + `</function>`, as far as it goes."""
    text = body.lstrip()
    if not text.startswith(FUNCTION) or (close := text.find(">")) < 0:
        return None, {}, False
    name = text[len(FUNCTION) : close].strip()
    if not name or "\n" in name:
        return None, {}, False
    tool = tools.get(name)
    props = (tool.parameters.get("properties") if tool else None) or {}
    params: dict[str, Any] = {}
    at = close + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        if text.startswith(PARAMETER, at):
            key_end = text.find(">", at)
            value_end = text.find(PARAMETER_END, key_end) if key_end >= 0 else -1
            if value_end < 0:
                return None, params, True
            key = text[at + len(PARAMETER) : key_end].strip()
            value = text[key_end + 1 : value_end]
            params[key] = read_value(value, props.get(key))
            at = value_end + len(PARAMETER_END)
            continue
        if text.startswith(FUNCTION_END, at) and not text[at + len(FUNCTION_END) :].strip():
            args = json.dumps(params, ensure_ascii=False)
            return ToolCall(name=name, arguments=args), params, True
        return None, params, True


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    begins = (CALL_BEGIN,)

    def close(self, begin: str, body: str, tools: dict[str, Tool]):
        """A block ends at the first `</tool_call>` before which it reads as a function; one
        that does not open with `<function=` is not a call and ends at the first tag."""
        start = 0
        while (end := body.find(CALL_END, start)) >= 0:
            inner = body[:end]
            if not inner.lstrip().startswith(FUNCTION):
                return end + len(CALL_END), None
            call, _, _ = read_function(inner, tools)
            if call is not None:
                return end + len(CALL_END), [call]
            start = end + 1
        return None

    def cut_short(self, begin: str, body: str, tools: dict[str, Tool]) -> list[ToolCall]:
        call, params, named = read_function(body, tools)
        if call is not None:  # whole but for its closing tag
            return [call]
        if not named:
            return []
        text = body.lstrip()
        name = text[len(FUNCTION) : text.find(">")].strip()
        return [ToolCall(name=name, arguments=partial_object(params))]

    def constraint(self, mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
        """Calls alone (`required`, `named`) or text until `<tool_call>` (`auto`); the name is
        a tool's, the parameters follow its schema in xgrammar's `qwen_xml` style."""
        tags = [
            {
                "type": "tag",
                "begin": f"{CALL_BEGIN}\n{FUNCTION}{t.name}>\n",
                "content": json_content(t.parameters, style="qwen_xml"),
                "end": f"\n{FUNCTION_END}\n{CALL_END}",
            }
            for t in tools
        ]
        return per_call_tags(mode, tags, CALL_BEGIN, "\n", parallel)

    def detect(self, template: str) -> bool:
        return FUNCTION in template and PARAMETER in template

    def write_calls(self, calls) -> str:
        written = []
        for name, args in calls:
            obj = as_dict(args)
            written.append(format_call(name, obj if obj is not None else {}))
        return "\n".join(written)

    def write_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def preamble(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
