"""Mistral (7B v0.3, Nemo, Small; vLLM's `mistral`): `[TOOL_CALLS]` then a JSON array of
calls::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

The parser also reads the newer tokenizers' (v11+) form, one `[TOOL_CALLS]` per call with
the arguments after `[ARGS]`: `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`. The
constraint and the history use the array. `[TOOL_CALLS]` is a control token in Mistral's
own tokenizers: a server for them must decode it (skip_special_tokens off for requests with
tools), and a constrained call spells it from ordinary tokens (special tokens never match a
grammar's text). History: tool results go back as `[TOOL_RESULTS] ... [/TOOL_RESULTS]`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from actors.tool_calls.common import (
    Tool,
    ToolCall,
    ToolFormat,
    as_dict,
    balanced_end,
    json_call,
    json_content,
    structural_tag,
    tags_with_separator,
)
from actors.tool_calls.hermes import cut_short_json_call, parse_json_call

CALLS_BEGIN = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")

TOOLS_PREAMBLE = (
    "[AVAILABLE_TOOLS] {tools}[/AVAILABLE_TOOLS]\n\n"
    "To call functions, answer with [TOOL_CALLS] followed by a JSON array of calls, each "
    'of the form {{"name": <function-name>, "arguments": <args-json-object>}}, and nothing '
    "else."
)


class Mistral(ToolFormat):
    name = "mistral"
    begins = (CALLS_BEGIN,)
    special_markers = True

    def close(self, begin: str, body: str, tools: dict[str, Tool]):
        start = len(body) - len(body.lstrip())
        if start == len(body):
            return None
        if body[start] == "[":
            end = balanced_end(body, start)
            if end is None:
                return None
            try:
                items = json.loads(body[start:end])
            except json.JSONDecodeError:
                return end, None
            calls = [json_call(item) for item in items] if isinstance(items, list) else []
            if not calls or None in calls:
                return end, None
            return end, calls
        # v11+: NAME[ARGS]{...}
        name = _NAME.match(body, start)
        if name is None:
            return 0, None
        rest = body[name.end() :]
        if len(rest) < len(ARGS):
            return None if ARGS.startswith(rest) else (name.end(), None)
        if not rest.startswith(ARGS):
            return name.end(), None
        args_at = name.end() + len(ARGS)
        if args_at == len(body):
            return None
        if body[args_at] != "{":
            return args_at, None
        end = balanced_end(body, args_at)
        if end is None:
            return None
        call = parse_json_call(
            json.dumps({"name": name.group()})[:-1] + ', "arguments": ' + body[args_at:end] + "}"
        )
        return end, (None if call is None else [call])

    def cut_short(self, begin: str, body: str, tools: dict[str, Tool]) -> list[ToolCall]:
        stripped = body.lstrip()
        if stripped.startswith("["):  # the complete calls of the array, then the open one
            calls: list[ToolCall] = []
            at = 1
            while True:
                while at < len(stripped) and stripped[at] in " \t\r\n,":
                    at += 1
                end = balanced_end(stripped, at) if stripped[at : at + 1] == "{" else None
                if end is None:
                    call = cut_short_json_call(stripped[at:])
                    return calls + [call] if call else calls
                call = parse_json_call(stripped[at:end])
                if call is None:
                    return calls
                calls.append(call)
                at = end
        name = _NAME.match(stripped)
        if name is None or not stripped[name.end() :].startswith(ARGS):
            return []
        args = stripped[name.end() + len(ARGS) :].rstrip()
        return [ToolCall(name=name.group(), arguments=args)]

    def constraint(self, mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
        """`[TOOL_CALLS] [` + calls separated by `, ` + `]`: alone (`required`, `named`) or
        after free text (`auto`, from `[TOOL_CALLS]` on); each name is a tool's and its
        arguments are valid against its schema."""
        if mode == "none" or not tools:
            return None
        tags = [
            {
                "type": "tag",
                "begin": f'{{"name": {json.dumps(t.name)}, "arguments": ',
                "content": json_content(t.parameters),
                "end": "}",
            }
            for t in tools
        ]
        single = mode == "named" or not parallel
        calls = tags_with_separator(tags, ", ", stop_after_first=single)
        block = {"type": "tag", "begin": f"{CALLS_BEGIN} [", "content": calls, "end": "]"}
        if mode == "auto":
            fmt: dict[str, Any] = {
                "type": "triggered_tags",
                "triggers": [CALLS_BEGIN],
                "tags": [block],
                "at_least_one": False,
                "stop_after_first": True,
            }
        else:
            fmt = block
        return structural_tag(fmt)

    def detect(self, template: str) -> bool:
        return CALLS_BEGIN in template

    def write_calls(self, calls) -> str:
        items = []
        for name, args in calls:
            obj = as_dict(args)
            items.append({"name": name, "arguments": obj if obj is not None else args})
        return f"{CALLS_BEGIN} {json.dumps(items, ensure_ascii=False)}"

    def write_result(self, content: str) -> str:
        return f"[TOOL_RESULTS] {content}[/TOOL_RESULTS]"

    def preamble(self, tools: list[dict[str, Any]]) -> str:
        return TOOLS_PREAMBLE.format(tools=json.dumps(tools, ensure_ascii=False))
