"""Pythonic calls (Llama 3.2 / Llama 4 / ToolACE; vLLM's `pythonic`): a Python list of
calls with keyword arguments whose values are literals::

    [get_weather(city='Paris', days=2), get_time(zone='UTC')]

A block begins at a `[` followed by a name and `(` (anything else after `[` is text) and ends
at its closing `]`; it is calls when Python reads it as a list of such calls (`true`,
`false` and `null` are read as JSON's, since constrained values may be spelled in JSON).
Llama 4's `<|python_start|>` / `<|python_end|>` markers are dropped.

Constraint (what is and is not guaranteed): each call's name is a tool's; its keywords are
the schema's properties, in the schema's order, each at most once, the required ones
always; each value is valid against its property's schema: booleans and null are spelled
`True`/`False`/`None`, enums and consts as Python literals, every other value as JSON (a
valid Python literal for strings, numbers, lists and objects, with nested booleans and
null spelled in JSON). Not enforced: keywords in another order, and constraints across
properties (`dependentRequired`, `if`/`then`...). A tool whose parameters schema lists no
properties takes no arguments unless it allows additional ones, which are then any
keyword = literal.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from actors.tool_calls.common import (
    MAX_JSON_WHITESPACE,
    Tool,
    ToolCall,
    ToolFormat,
    as_dict,
    balanced_end,
    outside_strings,
    partial_object,
    structural_tag,
    tags_with_separator,
)

LIST_BEGIN = "["
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}

TOOLS_PREAMBLE = (
    "You may call functions. To call them, answer with nothing but a Python list of calls "
    "with keyword arguments, as [func_name1(param1=value1, param2=value2), "
    "func_name2(param=value)], using Python literals as values.\n\n"
    "The functions you can call, in JSON:\n{tools}"
)


def literal(value: Any) -> str:
    """A JSON value as Python literal text."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{name}(" + ", ".join(f"{k}={literal(v)}" for k, v in arguments.items()) + ")"


def _value(node: ast.AST) -> Any:
    """A literal's value (JSON's true/false/null allowed); ValueError otherwise."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_key(k): _value(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def _key(node: ast.AST | None) -> str:
    key = _value(node) if node is not None else None
    if not isinstance(key, (str, int, float, bool)) and key is not None:
        raise ValueError("not a JSON key")
    return key if isinstance(key, str) else json.dumps(key)


def _func_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_func_name(node.value)}.{node.attr}"
    raise ValueError("not a name")


def _call(node: ast.AST) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("not a call with keyword arguments")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = _value(kw.value)
    return ToolCall(name=_func_name(node.func), arguments=json.dumps(args, ensure_ascii=False))


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of `[f(a=1), g(b='x')]`, or None when it is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        return [_call(node) for node in tree.body.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _head_end(body: str) -> int | None:
    """After `[`: the index past `name(` (spaces allowed around the name), -1 when the text
    cannot begin a call, None while it still may."""
    i = len(body) - len(body.lstrip())
    if i == len(body):
        return None
    if not (body[i].isalpha() or body[i] == "_"):
        return -1
    while i < len(body) and (body[i].isalnum() or body[i] in "_."):
        i += 1
    while i < len(body) and body[i] in " \t":
        i += 1
    if i == len(body):
        return None
    return i + 1 if body[i] == "(" else -1


class Pythonic(ToolFormat):
    name = "pythonic"
    begins = (LIST_BEGIN, PYTHON_START, PYTHON_END)

    def close(self, begin: str, body: str, tools: dict[str, Tool]):
        if begin != LIST_BEGIN:
            return 0, []  # a marker, not text
        head = _head_end(body)
        if head is None:
            return None
        if head < 0:
            return 0, None
        end = balanced_end(body, depth=1, quotes="\"'")
        if end is None:
            return None
        return end, parse_calls(LIST_BEGIN + body[:end])

    def cut_short(self, begin: str, body: str, tools: dict[str, Tool]) -> list[ToolCall]:
        """Complete calls, then the open one with the keywords it finished (when the request's
        tools are known, only if it names one of them)."""
        if begin != LIST_BEGIN:
            return []
        calls: list[ToolCall] = []
        at = 0
        while True:
            while at < len(body) and body[at] in " \t\r\n,":
                at += 1
            head = _head_end(body[at:])
            if head is None or head < 0:
                return calls
            end = balanced_end(body, at + head, depth=1, quotes="\"'")
            if end is None:
                name = body[at : at + head - 1].strip()
                if tools and name not in tools:  # `[word(` in text is too common a start
                    return calls
                return calls + [ToolCall(name=name, arguments=self._finished(body[at + head :]))]
            found = parse_calls(f"[{body[at:end]}]")
            if not found:
                return calls
            calls += found
            at = end

    @staticmethod
    def _finished(args: str) -> str:
        """The keywords of `a=1, b='x', c=` that are complete, as a JSON object cut short."""
        done: dict[str, Any] = {}
        at = 0
        while (comma := _top_level_comma(args, at)) is not None:
            try:
                done.update(
                    json.loads(_call(ast.parse(f"f({args[at:comma]})", mode="eval").body).arguments)
                )
            except (SyntaxError, ValueError):
                break
            at = comma + 1
        return partial_object(done)

    def constraint(self, mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
        if mode == "none" or not tools:
            return None
        tags = [
            {"type": "tag", "begin": f"{t.name}(", "content": _kwargs(t.parameters), "end": ")"}
            for t in tools
        ]
        single = mode == "named" or not parallel
        if mode != "auto":
            calls = tags_with_separator(tags, ", ", stop_after_first=single)
            return structural_tag({"type": "tag", "begin": "[", "content": calls, "end": "]"})
        # auto: text until `[name(`, then that call's arguments and (parallel) more calls
        more = (
            []
            if single
            else [{"type": "star", "content": {"type": "sequence", "elements": [
                {"type": "const_string", "value": ", "},
                {"type": "or", "elements": [_call_format(t) for t in tools]},
            ]}}]
        )  # fmt: skip
        first = [
            {
                "type": "tag",
                "begin": f"[{t.name}(",
                "content": {
                    "type": "sequence",
                    "elements": [
                        _kwargs(t.parameters),
                        {"type": "const_string", "value": ")"},
                        *more,
                    ],
                },
                "end": "]",
            }
            for t in tools
        ]
        return structural_tag(
            {
                "type": "triggered_tags",
                "triggers": [f"[{t.name}(" for t in tools],
                "tags": first,
                "at_least_one": False,
                "stop_after_first": True,
            }
        )

    def detect(self, template: str) -> bool:
        return "[func_name1(" in template or PYTHON_START in template

    def write_calls(self, calls) -> str:
        written = []
        for name, args in calls:
            obj = as_dict(args)
            written.append(format_call(name, obj if obj is not None else {}))
        return "[" + ", ".join(written) + "]"

    def preamble(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))


def _top_level_comma(text: str, start: int) -> int | None:
    """The first comma at or after `start` outside brackets and strings."""
    depth = 0
    for i, c in outside_strings(text, start, "\"'"):
        if c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            return i
    return None


# ---- the arguments' grammar ------------------------------------------------------------------


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _call_format(tool: Tool) -> dict[str, Any]:
    return {
        "type": "sequence",
        "elements": [_const(f"{tool.name}("), _kwargs(tool.parameters), _const(")")],
    }


def _value_format(schema: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """One keyword's value: Python spellings where they differ from JSON, else JSON."""
    if isinstance(schema, dict):
        for key in ("enum", "const"):
            if key in schema:
                values = schema[key] if key == "enum" else [schema[key]]
                if isinstance(values, list) and values:
                    options = [_const(literal(v)) for v in values]
                    return options[0] if len(options) == 1 else {"type": "or", "elements": options}
        kind = schema.get("type")
        if kind == "boolean":
            return {"type": "or", "elements": [_const("True"), _const("False")]}
        if kind == "null":
            return _const("None")
        if isinstance(kind, list) and kind:
            return {
                "type": "or",
                "elements": [_value_format({**schema, "type": k}, defs) for k in kind],
            }
        if defs:
            schema = {**schema, **defs}
    return {
        "type": "json_schema",
        "json_schema": schema,
        "max_whitespace_cnt": MAX_JSON_WHITESPACE,
    }


def _kwargs(schema: dict[str, Any]) -> dict[str, Any]:
    """`k1=v1, k2=v2` for an object schema: its properties in order, optional ones skippable."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        if isinstance(schema, dict) and schema.get("additionalProperties", True) is False:
            return _const("")
        if isinstance(schema, dict) and "properties" in schema:
            return _const("")
        return _any_kwargs()
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    required = set(schema.get("required") or [])
    items = [(k, _value_format(v, defs)) for k, v in props.items()]

    def tail(after: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for key, value in items[after + 1 :]:
            part = {"type": "sequence", "elements": [_const(f", {key}="), value]}
            out.append(part if key in required else {"type": "optional", "content": part})
        return out

    options: list[dict[str, Any]] = []
    for i, (key, value) in enumerate(items):
        options.append({"type": "sequence", "elements": [_const(f"{key}="), value, *tail(i)]})
        if key in required:
            break
    else:
        options.append(_const(""))
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


def _any_kwargs() -> dict[str, Any]:
    """Any `name=literal` list (a schema without properties that allows any)."""
    return {
        "type": "grammar",
        "grammar": (
            'root ::= ("" | kw ("," " " kw)*)\n'
            'kw ::= [a-zA-Z_] [a-zA-Z0-9_]* "=" value\n'
            'value ::= number | string | "True" | "False" | "None" | list | dict\n'
            'number ::= "-"? [0-9]+ ("." [0-9]+)?\n'
            'string ::= "\'" ([^\'\\\\\\n] | "\\\\" [^\\n])* "\'"\n'
            'list ::= "[" ("" | value (", " value)*) "]"\n'
            'dict ::= "{" ("" | string ": " value (", " string ": " value)*) "}"\n'
        ),
    }
