"""What every tool-call format shares: the request's tools, the calls, `tool_choice`, the
incremental parser and the history writer; each format module fills in its syntax.

A format is a `ToolFormat`. Its parser (`CallParser`) is one algorithm for all of them: text
is content until one of the format's `begins` markers; from there a block runs until the
format's `close` says where it ends and what it holds (calls, or None: not calls, so the
block is content as written). `close` sees only the block's text so far and decides at the
first point where the text settles it, so feeding the text in any pieces splits it exactly
as feeding it whole does.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

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
    arguments: str  # JSON text of the arguments object (cut short: as far as it came)
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


# ---- the format ------------------------------------------------------------------------------


class ToolFormat(ABC):
    """One model family's way of writing tool calls. Subclasses set the class attributes and
    implement `close`, `cut_short`, `constraint`, `write_calls` and `preamble`."""

    name = ""
    begins: tuple[str, ...] = ()  # markers that open a block
    blanks = " \t\r\n"  # characters held back between calls (dropped there)
    # The markers are special tokens in the models' own tokenizers (decode them, do not skip).
    special_markers = False

    # -- output --------------------------------------------------------------------------------
    @abstractmethod
    def close(
        self, begin: str, body: str, tools: dict[str, Tool]
    ) -> tuple[int, list[ToolCall] | None] | None:
        """Where the block opened by `begin` ends (the length of `body` it takes) and its calls
        (None: not calls, the block is content as written), or None while undecided."""

    def cut_short(self, begin: str, body: str, tools: dict[str, Tool]) -> list[ToolCall]:
        """The calls of a block the text ended inside (max_tokens): the complete ones, then the
        one being written once its name is whole, with its arguments as far as they came."""
        return []

    def parser(self, calls_only: bool = False, tools: list[Tool] | None = None) -> CallParser:
        """An incremental parser. `tools`: the request's, where a format needs their schemas
        to read argument values (qwen3_coder's parameters are text)."""
        return CallParser(self, calls_only, tools)

    def parse(
        self, text: str, calls_only: bool = False, tools: list[Tool] | None = None
    ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole generation; content is None when only calls were made
        (or, with `calls_only`, none)."""
        parser = self.parser(calls_only, tools)
        parser.feed(text)
        parser.finish()  # its calls are in parser.calls too
        content = "".join(parser.content)
        if (parser.calls or calls_only) and not content.strip():
            return None, parser.calls
        return content, parser.calls

    # -- constraint ----------------------------------------------------------------------------
    @abstractmethod
    def constraint(self, mode: str, tools: list[Tool], parallel: bool = True) -> str | None:
        """The xgrammar structural tag (JSON text) of `tool_choice` `mode`; None for none."""

    # -- prompt --------------------------------------------------------------------------------
    def detect(self, template: str) -> bool:
        """Whether a chat template's text shows this format."""
        return False

    @abstractmethod
    def write_calls(self, calls: list[tuple[str, dict[str, Any] | str]]) -> str:
        """An assistant turn's calls, as the model writes them."""

    def write_result(self, content: str) -> str:
        """A tool's result, as the user turn that carries it back."""
        return content

    @abstractmethod
    def preamble(self, tools: list[dict[str, Any]]) -> str:
        """The system-message text that describes the tools and this format."""

    def prompt_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], native: bool
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(messages, extra template variables) for a chat that may involve tools.

        `native`: the template renders tools itself (it gets `tools` and the history, with
        call arguments as objects, as transformers passes them). Otherwise the tools go into
        the system message and the history is written in this format: assistant calls in the
        model's syntax, tool results as user turns (adjacent user turns merged: templates
        such as Gemma's want user and model turns to alternate)."""
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
            role, content = m.get("role"), text_of(m.get("content"))
            if role == "assistant" and m.get("tool_calls"):
                calls = self.write_calls(
                    [
                        (c["function"]["name"], c["function"].get("arguments") or "{}")
                        for c in m["tool_calls"]
                    ]
                )
                out.append(
                    {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
                )
            elif role == "tool":
                _append_user(out, self.write_result(content))
            elif role == "user":
                _append_user(out, content)
            else:
                out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
        if tools:
            preamble = self.preamble(tools)
            if out and out[0].get("role") in ("system", "developer"):
                first = text_of(out[0].get("content"))
                out[0] = {
                    "role": "system",
                    "content": f"{first}\n\n{preamble}" if first else preamble,
                }
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out, {}


# ---- the parser ------------------------------------------------------------------------------


class CallParser:
    """Splits a generation into content and tool calls, as text arrives.

    `feed` returns the content that is certain (text that cannot be the start of a block;
    blanks are held until other text follows, so the blanks between calls never become
    content) and the calls whose block closed; `finish` returns the rest. A block that is
    not calls is content, as written. A block cut short by the end of the text (max_tokens)
    gives the calls `ToolFormat.cut_short` finds (a call whose name is whole, with its
    arguments as far as they came, as OpenAI returns one); with none it is content, unless
    the output was constrained to calls alone (`calls_only`: tool_choice required or named),
    where it is dropped: such an output has no content to show."""

    def __init__(self, fmt: ToolFormat, calls_only: bool = False, tools=None) -> None:
        self.format = fmt
        self.calls_only = calls_only
        self.tools = {t.name: t for t in tools or []}
        self._buf = ""
        self._open: str | None = None  # the marker of the open block
        self._blank = ""  # blanks held back
        self.calls: list[ToolCall] = []
        self.content: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._open is not None:
                found = self.format.close(self._open, self._buf, self.tools)
                if found is None:
                    break
                end, block_calls = found
                body, self._buf = self._buf[:end], self._buf[end:]
                begin, self._open = self._open, None
                if block_calls is None:
                    out.append(self._take_blank() + begin + body)
                elif block_calls:
                    self._blank = ""
                    calls += block_calls
                continue
            at, begin = _first_marker(self._buf, self.format.begins)
            if begin:
                out.append(self._settle(self._buf[:at]))
                self._buf = self._buf[at + len(begin) :]
                self._open = begin
                continue
            keep = max((partial_suffix(self._buf, m) for m in self.format.begins), default=0)
            out.append(self._settle(self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            break
        text_out = "".join(out)
        self.content.append(text_out)
        self.calls += calls
        return text_out, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text still held (an unfinished marker, or a block cut short before any call
        took shape, is content as written), and the calls of a block cut short, if any."""
        cut: list[ToolCall] = []
        if self._open is not None:
            cut = self.format.cut_short(self._open, self._buf, self.tools)
        dropped = bool(cut) or self.calls_only  # calls alone: a marker's prefix is no text
        rest = "" if dropped else (self._open or "") + self._buf
        self.calls += cut
        # Blanks after the last call are dropped; blanks ending plain text are kept.
        tail = self._blank + rest if rest.strip() or not self.calls else ""
        self._buf, self._blank, self._open = "", "", None
        self.content.append(tail)
        return tail, cut

    def _settle(self, text: str) -> str:
        """`text` plus the blanks held before it, keeping its own trailing blanks back."""
        if not text:
            return ""
        stripped = text.rstrip(self.format.blanks)
        if not stripped:
            self._blank += text
            return ""
        out = self._take_blank() + stripped
        self._blank = text[len(stripped) :]
        return out

    def _take_blank(self) -> str:
        blank, self._blank = self._blank, ""
        return blank


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(where, which) of the earliest marker in `text` (the longest at a tie); (-1, "")."""
    best, which = -1, ""
    for m in markers:
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best or (at == best and len(m) > len(which))):
            best, which = at, m
    return best, which


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def outside_strings(text: str, start: int = 0, quotes: str = '"'):
    """(index, character) of every character of `text` from `start` that is not inside a
    string quoted by one of `quotes` (backslash escapes honoured); the quotes themselves are
    skipped too."""
    in_string = ""
    escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == in_string:
                in_string = ""
        elif c in quotes:
            in_string = c
        else:
            yield i, c


def balanced_end(text: str, start: int = 0, depth: int = 0, quotes: str = '"') -> int | None:
    """The index just past the bracket that brings `depth` back to 0, scanning `text` from
    `start` (strings in `quotes`, with backslash escapes, are skipped); None if the text ends
    first. Brackets of all kinds count alike: a mismatch is the caller's parse error."""
    for i, c in outside_strings(text, start, quotes):
        if c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
            if depth <= 0:
                return i + 1
    return None


def arguments_json(args: Any) -> str | None:
    """The JSON text of a call's arguments given as an object or as its JSON text; None when
    they are neither (not a call)."""
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def json_call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or the first of `keys` present) as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    text = arguments_json(args)
    return None if text is None else ToolCall(name=obj["name"], arguments=text)


def as_dict(arguments: dict[str, Any] | str) -> dict[str, Any] | None:
    """A history call's arguments (a dict or its JSON text) as a dict; None if not JSON."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def arguments_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def partial_object(items: dict[str, Any]) -> str:
    """The JSON text of an object cut short after `items` (no closing brace); "" for none."""
    if not items:
        return ""
    return json.dumps(items, ensure_ascii=False)[:-1]


# ---- structural tags -------------------------------------------------------------------------


def json_content(schema: dict[str, Any], style: str = "json") -> dict[str, Any]:
    """Arguments valid against `schema`, written as JSON (or in xgrammar's `style`)."""
    content = {"type": "json_schema", "json_schema": schema}
    if style != "json":
        content["style"] = style
    content["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
    return content


def tags_with_separator(
    tags: list[dict[str, Any]], separator: str, stop_after_first: bool
) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": stop_after_first,
    }


def per_call_tags(
    mode: str, tags: list[dict[str, Any]], trigger: str, separator: str, parallel: bool
) -> str | None:
    """The structural tag of a format that writes each call as its own tag: `auto` leaves
    text free until `trigger`, `required` and `named` allow calls alone."""
    if mode == "none" or not tags:
        return None
    if mode == "auto":
        fmt: dict[str, Any] = {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    elif mode == "named" or not parallel:
        fmt = tags[0] if len(tags) == 1 else tags_with_separator(tags, separator, True)
    else:
        fmt = tags_with_separator(tags, separator, False)
    return structural_tag(fmt)


def structural_tag(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


# ---- messages --------------------------------------------------------------------------------


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


def text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)
