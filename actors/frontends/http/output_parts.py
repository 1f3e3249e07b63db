"""One choice's generated text, split into what each API shows apart: reasoning, content and
tool calls.

The split is one pipeline for every API (chat completions, Responses, Messages): the
reasoning splitter (`actors.reasoning`, when the server runs with `--reasoning-parser`)
takes the text until the reasoning ends, and everything after it goes through the tool-call
parser of the server's format (`actors.tool_calls`, when the request declared tools).
Both are incremental and hold back only what may still turn out to be a tag, so the parts
streamed chunk by chunk are the parts of the whole text, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.tool_calls import Tool, ToolCall, tool_format


@dataclass(frozen=True)
class OutputPolicy:
    """How a request's output is split (the same for each of its choices)."""

    tool_format: str | None = None  # the tool-call format's name; None: tools not parsed
    calls_only: bool = False  # tool_choice required or named: the output is calls alone
    tools: tuple[Tool, ...] = ()  # the callable tools (a format may read values by schema)
    reasoning: str = ""  # the reasoning parser's name; "": no reasoning split


@dataclass
class Parts:
    """What a piece of generated text turned out to be, in this order within the piece."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class OutputSplitter:
    """`feed(text)` per chunk, then `finish()` once; each returns the parts made certain."""

    def __init__(self, policy: OutputPolicy, prompt_tail: str = "") -> None:
        self.reasoning = None
        if policy.reasoning:
            from actors.reasoning import reasoning_format

            self.reasoning = reasoning_format(policy.reasoning).splitter(prompt_tail)
        self.tools = (
            tool_format(policy.tool_format).parser(policy.calls_only, list(policy.tools))
            if policy.tool_format is not None
            else None
        )
        self.calls: list[ToolCall] = []  # every call so far

    def feed(self, text: str) -> Parts:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._content(reasoning, content, final=False)

    def finish(self) -> Parts:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._content(reasoning, content, final=True)

    def _content(self, reasoning: str, content: str, final: bool) -> Parts:
        if self.tools is None:
            return Parts(reasoning, content)
        text, calls = self.tools.feed(content) if content else ("", [])
        if final:
            tail, cut = self.tools.finish()
            text, calls = text + tail, calls + cut
        self.calls += calls
        return Parts(reasoning, text, calls)


def split_whole(policy: OutputPolicy, text: str, prompt_tail: str = "") -> Parts:
    """The parts of a whole generation: content is what is left once reasoning and calls
    are taken out."""
    splitter = OutputSplitter(policy, prompt_tail)
    first, last = splitter.feed(text), splitter.finish()
    return Parts(
        first.reasoning + last.reasoning, first.content + last.content, first.calls + last.calls
    )
