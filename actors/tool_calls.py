"""Tool calls: the one format the engine speaks, its grammar, its parser and its prompt.

The format is the Hermes convention (Qwen 2.5 and Qwen 3 use it natively): each call is a
JSON object in tags, calls one after another::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `tool_constraint` turns OpenAI's `tools` + `tool_choice` + `parallel_tool_calls` into an
  xgrammar structural tag: `required` and a named tool allow nothing but calls (the name
  from the list, the arguments valid against that tool's schema); `auto` leaves text free
  and constrains whatever follows a `<tool_call>` trigger to a valid call; `none` adds none.
- `ToolCallParser` splits generated text into content and calls, incrementally (streaming
  sends each call as soon as its closing tag arrives) or at once.
- `prompt_messages` prepares the conversation for the chat template. A template that knows
  tools (it mentions `tools`, as Qwen's does) gets them and the history as they are. One
  that does not (Gemma 3 has no tool format) gets the tools described in the system message
  with the format above, assistant calls written out in it, and tool results as user turns
  wrapped in `<tool_response>` tags (Gemma's template wants user and model turns to
  alternate, so adjacent user turns are merged).

Nothing here runs a model or an actor: the gateway and the tokenizer both use it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
# Whitespace a constrained call may put between JSON tokens (more invites loops).
MAX_JSON_WHITESPACE = 1
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    """`tools`/`tool_choice` that cannot be served; starts with the field's name."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object (cut short: see `_cut_short_call`)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def resolve_tool_choice(tools: list[Tool], tool_choice: Any) -> tuple[str, list[Tool]]:
    """("none" | "auto" | "required" | "named", the tools it may call)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolSpecError("tool_choice: given without tools")
        return "none", []
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolSpecError("tools: function names must be unique")
    if tool_choice is None:
        return "auto", tools
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, tools if tool_choice != "none" else []
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolSpecError(
                'tool_choice: expected "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            raise ToolSpecError(f"tool_choice: no tool named {name!r} in tools")
        return "named", [t for t in tools if t.name == name]
    raise ToolSpecError('tool_choice: expected "none", "auto", "required" or a named function')


def tool_constraint(mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
    """The structural tag (JSON text) that keeps calls well-formed; None for `none`."""
    if mode == "none" or not tools:
        return None
    tags = [_call_tag(t) for t in tools]
    if mode == "auto":
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": [CALL_BEGIN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    elif mode == "named" or not parallel:
        fmt = tags[0] if len(tags) == 1 else _tags_with_separator(tags, stop_after_first=True)
    else:
        fmt = _tags_with_separator(tags, stop_after_first=False)
    return json.dumps({"type": "structural_tag", "format": fmt})


def _call_tag(tool: Tool) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": f'{CALL_BEGIN}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
        "content": {
            "type": "json_schema",
            "json_schema": tool.parameters,
            "max_whitespace_cnt": MAX_JSON_WHITESPACE,
        },
        "end": f"}}\n{CALL_END}",
    }


def _tags_with_separator(tags: list[dict[str, Any]], stop_after_first: bool) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": stop_after_first,
    }


def format_call(name: str, arguments: Any) -> str:
    """One call in the engine's format (`arguments`: a dict or its JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{CALL_END}'


class ToolCallParser:
    """Splits a generation into content and tool calls, as text arrives.

    `feed` returns the content that is certain (text that cannot be the start of a call;
    whitespace is held until non-blank text follows, so the blanks between calls never
    become content) and the calls whose closing tag arrived; `finish` returns the rest. A
    block that is not a valid call is content, as written: at its closing tag when it does
    not open with `{`, at the end of the text when it does but never parses. A call cut
    short by the end of the text (max_tokens) after its name is a call with the arguments
    as far as they came, as OpenAI returns one; before its name it is content, unless the
    output was constrained to calls alone (`calls_only`: tool_choice required or named),
    where it is dropped: such an output has no content to show."""

    def __init__(self, calls_only: bool = False) -> None:
        self.calls_only = calls_only
        self._buf = ""
        self._in_call = False
        self._blank = ""  # whitespace held back
        self.calls: list[ToolCall] = []
        self.content: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                found = self._close_call()
                if found is None:
                    break
                end, call = found
                body, self._buf = self._buf[:end], self._buf[end + len(CALL_END) :]
                self._in_call = False
                if call is None:
                    out.append(self._take_blank() + CALL_BEGIN + body + CALL_END)
                else:
                    self._blank = ""
                    calls.append(call)
                continue
            begin = self._buf.find(CALL_BEGIN)
            if begin >= 0:
                out.append(self._settle(self._buf[:begin]))
                self._buf = self._buf[begin + len(CALL_BEGIN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, CALL_BEGIN)
            out.append(self._settle(self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            break
        text_out = "".join(out)
        self.content.append(text_out)
        self.calls += calls
        return text_out, calls

    def _close_call(self) -> tuple[int, ToolCall | None] | None:
        """Where the open call's block ends, and its call (None: not a call), or None while
        it may still go on. A block ends at the first `</tool_call>` before which it parses
        (the tag may also appear inside an argument string); one that does not open with `{`
        is not a call and ends at the first tag. Both depend only on text already seen, so
        streaming splits text exactly as the whole-text parse does."""
        start = 0
        while (end := self._buf.find(CALL_END, start)) >= 0:
            body = self._buf[:end]
            if not body.lstrip().startswith("{"):
                return end, None
            call = _parse_call(body)
            if call is not None:
                return end, call
            start = end + 1
        return None

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text still held (an unfinished tag prefix, or a call cut short before its
        name, is content as written), and the call cut short after its name, if any."""
        cut = _cut_short_call(self._buf) if self._in_call else None
        dropped = cut is not None or self.calls_only  # calls alone: a tag prefix is no text
        rest = "" if dropped else (CALL_BEGIN if self._in_call else "") + self._buf
        calls = [cut] if cut else []
        self.calls += calls
        # Blanks after the last call are dropped; blanks ending plain text are kept.
        tail = self._blank + rest if rest.strip() or not self.calls else ""
        self._buf, self._blank, self._in_call = "", "", False
        self.content.append(tail)
        return tail, calls

    def _settle(self, text: str) -> str:
        """`text` plus the whitespace held before it, keeping its own trailing blanks back."""
        if not text:
            return ""
        stripped = text.rstrip()
        if not stripped:
            self._blank += text
            return ""
        out = self._take_blank() + stripped
        self._blank = text[len(stripped) :]
        return out

    def _take_blank(self) -> str:
        blank, self._blank = self._blank, ""
        return blank


def parse_tool_calls(text: str, calls_only: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generation; content is None when only calls were made
    (or, with `calls_only`, none)."""
    parser = ToolCallParser(calls_only)
    parser.feed(text)
    parser.finish()  # its calls are in parser.calls too
    content = "".join(parser.content)
    if (parser.calls or calls_only) and not content.strip():
        return None, parser.calls
    return content, parser.calls


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


_NAME_THEN_ARGUMENTS = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def _cut_short_call(body: str) -> ToolCall | None:
    """The call an unfinished block began, when its name is whole: the arguments are the
    text that followed, as far as it came (not valid JSON)."""
    found = _NAME_THEN_ARGUMENTS.match(body)
    if found is None:
        return None
    return ToolCall(name=json.loads(found.group(1)), arguments=body[found.end() :].rstrip())


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- the prompt ------------------------------------------------------------------------------

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def prompt_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a chat that may involve tools.

    `native`: the template renders tools itself (it gets `tools` and the history, with call
    arguments as objects, as transformers passes them). Otherwise the tools go into the
    system message and the history is written in the engine's format."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_native_call(c) for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                format_call(c["function"]["name"], c["function"].get("arguments") or "{}")
                for c in m["tool_calls"]
            )
            out.append(
                {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
            )
        elif role == "tool":
            _append_user(out, f"<tool_response>\n{content}\n</tool_response>")
        elif role == "user":
            _append_user(out, content)
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0].get("role") in ("system", "developer"):
            first = _text(out[0].get("content"))
            out[0] = {"role": "system", "content": f"{first}\n\n{preamble}" if first else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, {}


def _append_user(out: list[dict[str, Any]], content: str) -> None:
    if out and out[-1].get("role") == "user":
        out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{content}"}
    else:
        out.append({"role": "user", "content": content})


def _native_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)
