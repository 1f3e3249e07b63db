"""Tool calls: the formats the engine speaks, their grammars, parsers and prompts.

`serve --tool-call-parser NAME` picks one format for the server (`auto`: the one the chat
template shows, `resolve_tool_format`); each is a `ToolFormat` (`tool_format(name)`):

| name | a call as the model writes it | module |
|---|---|---|
| hermes | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` | `hermes` |
| llama3_json | `{"name": ..., "parameters": {...}}` (`; ` between calls) | `llama3_json` |
| mistral | `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` | `mistral` |
| pythonic | `[get_weather(city='Paris'), ...]` | `pythonic` |
| qwen3_coder | `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...` | |

Each gives:
- `constraint(mode, tools, parallel)`: OpenAI's `tools` + `tool_choice` +
  `parallel_tool_calls` as an xgrammar structural tag: `required` and a named tool allow
  nothing but calls (the name from the list, the arguments valid against that tool's
  schema, as far as the format lets a grammar say; each module says what is guaranteed);
  `auto` leaves text free until the format's trigger; `none` adds none.
- `parser(calls_only, tools)`: splits generated text into content and calls, incrementally
  (streaming sends each call as soon as its block closes) or at once (`parse`); both split
  a text the same way.
- `prompt_messages(messages, tools, native)`: the conversation for the chat template. A
  template that knows tools (it mentions `tools`) gets them and the history as they are;
  one that does not (Gemma 3 has no tool format) gets the tools described in the system
  message, assistant calls written out in the format, and tool results as user turns.

The module-level names (`ToolCallParser`, `parse_tool_calls`, `tool_constraint`,
`prompt_messages`, `format_call`, `TOOLS_PREAMBLE`) are Hermes', the default.
Nothing here runs a model or an actor: the gateway and the tokenizer both use it.
"""

from __future__ import annotations

from typing import Any

from actors.tool_calls.common import (
    CallParser,
    Tool,
    ToolCall,
    ToolFormat,
    ToolSpecError,
    resolve_tool_choice,
)
from actors.tool_calls.hermes import TOOLS_PREAMBLE, Hermes, format_call
from actors.tool_calls.llama3_json import Llama3Json
from actors.tool_calls.mistral import Mistral
from actors.tool_calls.pythonic import Pythonic
from actors.tool_calls.qwen3_coder import Qwen3Coder

__all__ = [
    "FORMATS",
    "TOOLS_PREAMBLE",
    "CallParser",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolFormat",
    "ToolSpecError",
    "format_call",
    "parse_tool_calls",
    "prompt_messages",
    "resolve_tool_choice",
    "resolve_tool_format",
    "template_knows_tools",
    "tool_constraint",
    "tool_format",
]

FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Pythonic(), Qwen3Coder())
}
# `auto` tries these in order (Qwen3-Coder's template also holds `<tool_call>`; pythonic
# Llama templates also name the `ipython` role).
DETECTION_ORDER = ("qwen3_coder", "hermes", "mistral", "pythonic", "llama3_json")
DEFAULT_FORMAT = "hermes"


def tool_format(name: str) -> ToolFormat:
    """The format called `name` ("auto" with no template to go by: Hermes); ValueError
    naming the known ones."""
    try:
        return FORMATS[DEFAULT_FORMAT if name == "auto" else name]
    except KeyError:
        known = ", ".join(FORMATS)
        raise ValueError(f"unknown tool-call format {name!r}; known: auto, {known}") from None


def resolve_tool_format(name: str, template: str | None) -> str:
    """`name`, or for "auto" the format whose markers the chat template shows (Hermes when
    none does, or there is no template)."""
    if name != "auto":
        return tool_format(name).name  # ValueError for an unknown one
    for candidate in DETECTION_ORDER:
        if template and FORMATS[candidate].detect(template):
            return candidate
    return DEFAULT_FORMAT


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


class ToolCallParser(CallParser):
    """Hermes' incremental parser (`tool_format(name).parser(...)` for the others)."""

    def __init__(self, calls_only: bool = False) -> None:
        super().__init__(FORMATS["hermes"], calls_only)


def parse_tool_calls(
    text: str, calls_only: bool = False, fmt: str = DEFAULT_FORMAT
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generation in format `fmt`; content is None when only
    calls were made (or, with `calls_only`, none)."""
    return tool_format(fmt).parse(text, calls_only)


def tool_constraint(
    mode: str, tools: list[Tool], parallel: bool = True, fmt: str = DEFAULT_FORMAT
) -> str | None:
    """The structural tag (JSON text) that keeps calls well-formed; None for `none`."""
    return tool_format(fmt).constraint(mode, tools, parallel)


def prompt_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    native: bool,
    fmt: str = DEFAULT_FORMAT,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables): see `ToolFormat.prompt_messages`."""
    return tool_format(fmt).prompt_messages(messages, tools, native)
