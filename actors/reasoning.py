"""Reasoning parsers (`serve --reasoning-parser NAME`): the model's thinking apart from its
answer, for the `<think>...</think>` convention of DeepSeek-R1, Qwen3 and their kin.

Pure Python (no torch, no xgrammar): the HTTP gateway imports it.

- `reasoning_format(name)` -> `ReasoningFormat`; `check_reasoning_parser(name)` validates a
  configured name at startup ("" is off).
- `ReasoningFormat.splitter(prompt_tail)` -> `ReasoningSplitter`: `feed(text)` per chunk and
  `finish()` once, each returning the `(reasoning, content)` made certain so far. Streamed
  output split at any character gives the parts of the whole text (it holds back only
  what may still be a tag or whitespace the split drops).
- `wrap_constraint(fmt, constraint)`: a structured-output or tool-call constraint that lets
  the model reason freely first, up to and including the closing tag.

Where the output starts. The prompt's last few tokens (`prompt_tail`, special tokens kept)
say whether the chat template opened the reasoning: it is open when its last `<think>`
comes after its last `</think>`, closed when its last `</think>` comes last (a template
with thinking disabled writes `<think>\\n\\n</think>\\n\\n`), and neither when it holds no
tag at all. Then, per format:

- `deepseek_r1` (vLLM's and SGLang's rule for DeepSeek-R1): the output starts in reasoning
  unless the prompt closed it. R1's template ends the prompt with `<think>\\n`, its older
  template did not, and the model then often skipped `<think>` yet wrote `</think>`: all
  text before `</think>` is reasoning, and output that never closes it is reasoning only.
  A prompt that closed it (thinking disabled) gives content from the start.
- `qwen3` (and `deepseek_v3`, and `think`, the generic name): reasoning only where the
  prompt opened it (Qwen3 2507 thinking templates, DeepSeek-V3.1 with thinking on) or in a
  `<think>` block the model writes at the very start of its output (Qwen3's own template).
  Anything else is content, so an instruct model that never thinks is never misread.

The split, for every format:

- An opening `<think>` is recognized only at the start of the output (after whitespace);
  when the output starts in reasoning the model may repeat it, and it is dropped.
- Reasoning ends at the first `</think>`; after it, everything is content, later tags
  included, as written. The tags themselves are in neither part.
- Whitespace: reasoning is stripped at both ends (the `\\n` after `<think>` and before
  `</think>`), and content loses the whitespace right after `</think>` (usually `\\n\\n`), as
  SGLang's parser and DeepSeek's own API return them (vLLM keeps both). Content of an
  output without reasoning is left as the model wrote it.
- An output cut short inside reasoning (max_tokens) is reasoning only, with empty content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from transport.messages.params import OutputConstraint

THINK_OPEN: Final = "<think>"
THINK_CLOSE: Final = "</think>"

# name -> whether the output starts in reasoning when the prompt holds no tag
_FORMATS: Final = {
    "deepseek_r1": True,
    "qwen3": False,
    "deepseek_v3": False,
    "think": False,
}
REASONING_PARSERS: Final = tuple(_FORMATS)

# Whitespace the model may write between `</think>` and a constrained answer (the split
# drops it): bounded so that a model cannot loop on newlines there.
GAP_PATTERN: Final = "[ \\t\\r\\n]{0,4}"
# Consecutive whitespace allowed inside JSON answers after reasoning: xgrammar's
# structural-tag JSON cannot express the compact style (`any_whitespace=False`) that
# kernels/grammar.py compiles a bare JSON constraint with; 1 keeps it as tight.
JSON_MAX_WHITESPACE: Final = 1

# Prompt states (`prompt_state`)
OPEN: Final = "open"
CLOSED: Final = "closed"
NONE: Final = "none"


class ReasoningConstraintError(ValueError):
    """A constraint `wrap_constraint` cannot put after reasoning; the message says why
    (it starts with the constraint's kind)."""


def _normal(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def check_reasoning_parser(name: str) -> str:
    """The canonical name of a configured parser ("" when off); ValueError naming the
    known ones otherwise. Call it where the server's config is validated."""
    if not name or not name.strip():
        return ""
    return reasoning_format(name).name


def reasoning_format(name: str) -> ReasoningFormat:
    """The format of a parser name (case and `-`/`_` are not significant)."""
    key = _normal(name)
    if key not in _FORMATS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; use one of {', '.join(REASONING_PARSERS)} "
            '(or "" for none)'
        )
    return ReasoningFormat(key, starts_without_tag=_FORMATS[key])


def prompt_state(prompt_tail: str, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE):
    """`OPEN` when the prompt's last reasoning tag opens it, `CLOSED` when it closes it,
    `NONE` when the tail holds neither."""
    opened, closed = prompt_tail.rfind(open_tag), prompt_tail.rfind(close_tag)
    if opened < 0 and closed < 0:
        return NONE
    return OPEN if opened > closed else CLOSED


@dataclass(frozen=True)
class ReasoningFormat:
    """One `<think>`-style convention. `starts_without_tag`: whether output whose prompt
    holds no tag starts in reasoning (deepseek_r1) or in content (qwen3)."""

    name: str
    starts_without_tag: bool
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether the output of a prompt ending in `prompt_tail` starts in reasoning."""
        state = prompt_state(prompt_tail, self.open_tag, self.close_tag)
        return state == OPEN or (state == NONE and self.starts_without_tag)

    def splitter(self, prompt_tail: str = "") -> ReasoningSplitter:
        """A splitter for one output of a prompt ending in `prompt_tail` (the decoded text of
        its last few tokens, special tokens kept: `Accepted.prompt_tail`)."""
        return ReasoningSplitter(self, self.starts_in_reasoning(prompt_tail))

    def split(self, text: str, prompt_tail: str = "") -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        s = self.splitter(prompt_tail)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return r1 + r2, c1 + c2


# Splitter states
_START_REASONING = 0  # at the start, in reasoning: the model may still repeat the open tag
_START_CONTENT = 1  # at the start, not in reasoning: the open tag may still come
_REASONING_LEAD = 2  # in reasoning, before its first non-whitespace
_REASONING = 3
_CONTENT_LEAD = 4  # right after the close tag, before content's first non-whitespace
_CONTENT = 5


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits one output, fed chunk by chunk. Every `feed` and the final `finish` return
    `(reasoning, content)`: the text of each part made certain by this call; the parts'
    concatenations over all calls are those of the whole text fed at once.

    Held back, never more: a possible partial tag, whitespace the split may drop (at the
    start, after the close tag, at the end of reasoning so far)."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self._state = _START_REASONING if in_reasoning else _START_CONTENT
        self._held = ""
        self._closed = False
        self.finished = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside reasoning (at the start of an output that
        does not start in reasoning: False until the model writes the open tag)."""
        return self._state in (_START_REASONING, _REASONING_LEAD, _REASONING)

    @property
    def reasoning_ended(self) -> bool:
        """Whether the close tag has been seen (the rest is content)."""
        return self._closed

    def feed(self, text: str) -> tuple[str, str]:
        if self.finished:
            raise RuntimeError("feed after finish")
        self._held += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """What is still held, as the end of the output decides it."""
        if self.finished:
            return "", ""
        out = self._run(final=True)
        self.finished = True
        return out

    def _run(self, final: bool) -> tuple[str, str]:
        open_tag, close_tag = self.fmt.open_tag, self.fmt.close_tag
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            held, state = self._held, self._state
            if state in (_START_REASONING, _START_CONTENT):
                rest = held.lstrip()
                if rest.startswith(open_tag):
                    self._held = rest[len(open_tag) :]
                    self._state = _REASONING_LEAD
                    continue
                if open_tag.startswith(rest) and not final:
                    break  # whitespace, or a beginning of the open tag: not known yet
                self._state = _REASONING_LEAD if state == _START_REASONING else _CONTENT
                continue
            if state == _REASONING_LEAD:
                self._held = held.lstrip()
                if not self._held:
                    break
                self._state = _REASONING
                continue
            if state == _REASONING:
                end = held.find(close_tag)
                if end >= 0:
                    reasoning.append(held[:end].rstrip())
                    self._held = held[end + len(close_tag) :]
                    self._state = _CONTENT_LEAD
                    self._closed = True
                    continue
                if final:
                    reasoning.append(held.rstrip())
                    self._held = ""
                    break
                keep = _partial_suffix(held, close_tag)
                body = held[: len(held) - keep].rstrip()
                reasoning.append(body)
                self._held = held[len(body) :]
                break
            if state == _CONTENT_LEAD:
                self._held = held.lstrip()
                if not self._held:
                    break
                self._state = _CONTENT
                continue
            # _CONTENT
            content.append(held)
            self._held = ""
            break
        return "".join(reasoning), "".join(content)


# ---- constraints after reasoning ------------------------------------------------------------


def _inner_format(constraint: OutputConstraint) -> dict[str, Any]:
    """The constraint as an xgrammar structural-tag format."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return {
            "type": "json_schema",
            "json_schema": {"type": "object"},
            "max_whitespace_cnt": JSON_MAX_WHITESPACE,
        }
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ReasoningConstraintError(f"json_schema: not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ReasoningConstraintError("json_schema: the schema must be a JSON object")
        return {
            "type": "json_schema",
            "json_schema": schema,
            "max_whitespace_cnt": JSON_MAX_WHITESPACE,
        }
    if kind == "regex":
        return {"type": "regex", "pattern": spec}
    if kind == "choice":
        if not constraint.choices:
            raise ReasoningConstraintError("choice: give at least one string")
        # the EBNF kernels/grammar.py's choice_grammar writes (JSON escapes are EBNF's)
        alts = " | ".join(
            json.dumps(c, ensure_ascii=False) if c else '""' for c in constraint.choices
        )
        return {"type": "grammar", "grammar": f"root ::= {alts}"}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec}
    if kind == "structural_tag":
        try:
            tag = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ReasoningConstraintError(f"structural_tag: not valid JSON: {exc}") from None
        if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
            raise ReasoningConstraintError(
                'structural_tag: only {"type": "structural_tag", "format": {...}} can follow '
                "reasoning (the legacy structures/triggers form cannot)"
            )
        return tag["format"]
    raise ReasoningConstraintError(f"{kind}: not a constraint kind reasoning can precede")


def _describes_reasoning(fmt: ReasoningFormat, constraint: OutputConstraint) -> bool:
    """Whether the constraint itself spells out the close tag (a regex, grammar, choice or
    structural tag that already shapes the reasoning): such a constraint is left as is."""
    tag = fmt.close_tag
    if constraint.kind in ("regex", "grammar", "structural_tag"):
        return tag in constraint.spec
    if constraint.kind == "choice":
        return any(tag in c for c in constraint.choices)
    return False


def wrap_constraint(
    fmt: ReasoningFormat | None,
    constraint: OutputConstraint | None,
    prompt_tail: str | None = None,
) -> OutputConstraint | None:
    """`constraint`, applied only once reasoning ends: a `structural_tag` constraint
    whose grammar lets the model write any text up to and including the close tag, then
    optional whitespace (at most 4 characters), then the original constraint.

    `prompt_tail` (the prompt's last tokens' text, as for `splitter`) makes the grammar
    exact: an output that starts in reasoning must close it before the answer (`<think>`
    repeated or not); one that does not may open a `<think>` block first, or answer at
    once; one whose prompt closed it (thinking disabled by the template) gets the
    constraint unchanged, from its first token. Without it (None: the prompt is not
    known) the grammar accepts either: free text up to `</think>` then the answer, or the
    answer alone. The price of not knowing: until `</think>` is written every token is
    allowed (the free-text branch is still open), and only where the output may end is
    checked; the tokenizer actor gives the tail (it wraps after rendering the prompt).

    Unchanged: None (no constraint, or `fmt` None: no reasoning parser), and a regex,
    grammar, choice or structural tag that already contains the close tag (it shapes the
    reasoning itself). Every kind wraps: json_object and json_schema (their whitespace is
    then bounded to one character in a row, not the compact style; see
    `JSON_MAX_WHITESPACE`), regex, choice, grammar (EBNF with a `root` rule), structural
    tags with a `format` (tool calls included). Raises `ReasoningConstraintError` for a
    spec it cannot read (whether the result compiles is the grammar engine's to say, as for
    any constraint; its errors then name `structural_tag`)."""
    if fmt is None or constraint is None or _describes_reasoning(fmt, constraint):
        return constraint
    if prompt_tail is not None and prompt_state(prompt_tail, fmt.open_tag, fmt.close_tag) == CLOSED:
        return constraint  # the template ended the reasoning: the answer starts at once
    inner = _inner_format(constraint)
    gap = {"type": "regex", "pattern": GAP_PATTERN}
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": fmt.close_tag}
    after_reasoning = {"type": "sequence", "elements": [thinking, gap, inner]}
    if prompt_tail is not None and fmt.starts_in_reasoning(prompt_tail):
        # `any_text` takes a repeated open tag as text; the split drops it
        top: dict[str, Any] = after_reasoning
    elif prompt_tail is not None:
        block = dict(thinking, begin=fmt.open_tag)
        top = {
            "type": "or",
            "elements": [{"type": "sequence", "elements": [block, gap, inner]}, inner],
        }
    else:
        top = {"type": "or", "elements": [after_reasoning, inner]}
    spec = json.dumps({"type": "structural_tag", "format": top}, ensure_ascii=False)
    return OutputConstraint(kind="structural_tag", spec=spec)
