"""Chat template rendering: OpenAI-style chat messages to prompt text.

Owns the checking and flattening of chat messages, the sandboxed jinja2 environment (set up as
Hugging Face's `apply_chat_template` sets it up, so Hub templates render the same) and the cache
of compiled templates. The template text comes from the tokenizer bundle
(kernels/tokenizer_loader.py supplies Gemma 3's when a GGUF carries none).

The rendered text already holds the template's BOS (Gemma's starts with `{{ bos_token }}`): encode
it without adding special tokens again.

A render is bounded where it runs (the thread that calls `render_chat`), so a template that
spins stops itself instead of running on after its request was refused. Invariant: every
step a template can repeat without bound passes `_tick`, which raises `RenderTimeout` once
the render's deadline has passed: each loop iteration (every `{% for %}`'s iterable is
wrapped at compile time), each call, attribute and item lookup, each filter, each `+ * **`
and `~`. The deadline alone cannot interrupt one long C-level operation, so those that could
take seconds in one step are refused by size first: an integer result over `MAX_INT_BITS`,
a string or list over `MAX_VALUE_LEN` items (filters' results are checked after the call).
This is cooperative (no thread is killed, no process spawned): a render costs only a clock
read per step, and the sandbox already confines what a template can reach.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Roles a chat message may have. "developer" (OpenAI's newer name for the system role) is
# rendered as "system", since templates only know the latter.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}
# Text parts of one message's content list are joined with this (as vLLM does).
CONTENT_PART_SEPARATOR = "\n"


# A render that takes longer stops with RenderTimeout (the tokenizer's own limit is the
# same: whichever fires first, the client gets a 400 and the render thread ends).
RENDER_TIMEOUT_S = 5.0
MAX_VALUE_LEN = 16 * 1024 * 1024  # items of one string or list a template may build
MAX_INT_BITS = 1 << 16  # an integer a template computes (~19,700 decimal digits)


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that cannot be compiled or run."""


class RenderTimeout(ChatTemplateError):
    """The render ran past its deadline and stopped itself."""


class _RenderBudget(threading.local):
    """The deadline of the render running in this thread (inf: none running)."""

    deadline: float = math.inf
    timeout_s: float = 0.0
    limit_s: float | None = None  # render_time_limit's, for renders in this thread


_budget = _RenderBudget()


@contextlib.contextmanager
def render_time_limit(timeout_s: float) -> Iterator[None]:
    """Renders in this thread within the block get `timeout_s` instead of RENDER_TIMEOUT_S."""
    outer = _budget.limit_s
    _budget.limit_s = timeout_s
    try:
        yield
    finally:
        _budget.limit_s = outer


def _tick() -> None:
    if time.monotonic() > _budget.deadline:
        raise RenderTimeout(f"the chat template did not render within {_budget.timeout_s:g} s")


def _check_size(value: Any) -> Any:
    """`value`, or ChatTemplateError when it is bigger than a template may build."""
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_VALUE_LEN:
        raise ChatTemplateError(f"the chat template built a value over {MAX_VALUE_LEN} items")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ChatTemplateError(f"the chat template built an integer over {MAX_INT_BITS} bits")
    return value


def _is_int(x: Any) -> bool:
    return isinstance(x, int)  # bool included


def _length(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before computing it, a `+`, `*` or `**` whose result would be too big."""
    if operator == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:
                raise ChatTemplateError(
                    f"the chat template computes an integer over {MAX_INT_BITS} bits"
                )
        return
    left_len, right_len = _length(left), _length(right)
    if operator == "*":
        if left_len is not None and _is_int(right):
            size = left_len * max(right, 0)
        elif right_len is not None and _is_int(left):
            size = right_len * max(left, 0)
        elif _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateError(
                    f"the chat template computes an integer over {MAX_INT_BITS} bits"
                )
            return
        else:
            return
    elif left_len is not None and right_len is not None:  # "+": concatenation
        size = left_len + right_len
    else:
        return
    if size > MAX_VALUE_LEN:
        raise ChatTemplateError(f"the chat template builds a value over {MAX_VALUE_LEN} items")


# ---------------------------------------------------------------- messages


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies of `messages`: known roles, string content (text parts flattened).

    Keys other than role and content are kept unless their value is None (as HF drops them).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        allowed = ", ".join(CHAT_ROLES)
        raise ChatTemplateError(f"{where}.role must be one of {allowed}; got {role!r}")
    if message.get("content") is None:
        raise ChatTemplateError(f"{where}.content is missing")
    normalized = {key: value for key, value in message.items() if value is not None}
    normalized["role"] = _ROLE_ALIASES.get(role, role)
    normalized["content"] = _flatten_content(where, message["content"])
    return normalized


def _flatten_content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        kind = type(content).__name__
        raise ChatTemplateError(
            f"{where}.content must be a string or a list of text parts; got {kind}"
        )
    if not content:
        raise ChatTemplateError(f"{where}.content must not be an empty list")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"{where}.content[{k}]: only text parts are supported; got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}.content[{k}].text must be a string")
        texts.append(text)
    return CONTENT_PART_SEPARATOR.join(texts)


# ---------------------------------------------------------------- the jinja environment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override: jinja's own tojson escapes HTML characters, which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _BudgetHooks(Extension):
    """What compiled templates call for the budget: `iterate` wraps every loop's iterable,
    `concat` is `~` (bound-checked). Bound into the code as extension attributes, so no
    template variable can shadow them."""

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _tick()
            yield item

    def concat(self, *parts: Any) -> str:
        _tick()
        texts = [str(p) for p in parts]
        if sum(map(len, texts)) > MAX_VALUE_LEN:
            raise ChatTemplateError(f"the chat template builds a value over {MAX_VALUE_LEN} items")
        return "".join(texts)


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with a `_tick` on every call, lookup and intercepted operator."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)


def _budgeted_filter(f: Any) -> Any:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def filtered(*args: Any, **kwargs: Any) -> Any:
        _tick()
        return _check_size(f(*args, **kwargs))

    return filtered


def _environment() -> _BudgetedSandbox:
    env = _BudgetedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, loopcontrols, _BudgetHooks],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()
_HOOKS = _BudgetHooks.identifier


def _with_budget(ast: nodes.Template) -> nodes.Template:
    """Route every loop's iterable through `iterate` and every `~` through `concat`."""
    for loop in ast.find_all(nodes.For):
        hook = nodes.ExtensionAttribute(_HOOKS, "iterate")
        loop.iter = nodes.Call(hook, [loop.iter], [], None, None, lineno=loop.lineno)
    for concat in list(ast.find_all(nodes.Concat)):
        call = nodes.Call(nodes.ExtensionAttribute(_HOOKS, "concat"), concat.nodes, [], None, None)
        # Concat has one field (`nodes`); turn the node into the call in place.
        concat.__class__ = nodes.Call
        for name in nodes.Call.fields:
            setattr(concat, name, getattr(call, name))
        del concat.nodes
    return ast


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached by its text), with its budget hooks in place."""
    try:
        code = _ENV.compile(_with_budget(_ENV.parse(template)))
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"invalid chat template: {exc}") from exc
    return _ENV.template_class.from_code(_ENV, code, _ENV.make_globals(None))


# ---------------------------------------------------------------- rendering


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    bos_token: str,
    eos_token: str,
    **template_vars: Any,
) -> str:
    """Render `messages` with `template`, as HF's `apply_chat_template(..., tokenize=False)`.

    `template_vars` reach the template as variables (tools, documents, enable_thinking, ...).
    Raises ChatTemplateError (a ValueError) for invalid messages, for a template's own
    `raise_exception`, for templates that fail or break the sandbox, and (RenderTimeout) for
    a render still running after RENDER_TIMEOUT_S (or `render_time_limit`'s): it stops
    itself there, in its own thread. (The limit is no parameter here: `template_vars` come
    from clients and must not be able to set it.)
    """
    compiled = compile_template(template)
    context = {
        **template_vars,
        "messages": normalize_messages(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    timeout_s = _budget.limit_s if _budget.limit_s is not None else RENDER_TIMEOUT_S
    outer = (_budget.deadline, _budget.timeout_s)  # a render within a render keeps the first's
    _budget.deadline = min(outer[0], time.monotonic() + timeout_s)
    _budget.timeout_s = timeout_s if _budget.deadline != outer[0] else outer[1]
    try:
        return compiled.render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
    finally:
        _budget.deadline, _budget.timeout_s = outer
