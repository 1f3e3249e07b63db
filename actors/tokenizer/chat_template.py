"""Chat template rendering: OpenAI-style chat messages to prompt text.

Owns the checking and flattening of chat messages, the sandboxed jinja2 environment (set up as
Hugging Face's `apply_chat_template` sets it up, so Hub templates render the same) and the cache
of compiled templates. The template text comes from the tokenizer bundle
(kernels/tokenizer_loader.py supplies Gemma 3's when a GGUF carries none).

The rendered text already holds the template's BOS (Gemma's starts with `{{ bos_token }}`): encode
it without adding special tokens again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that cannot be compiled or run."""


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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached by its text)."""
    try:
        return _ENV.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"invalid chat template: {exc}") from exc


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
    `raise_exception`, and for templates that fail or break the sandbox.
    """
    compiled = compile_template(template)
    context = {
        **template_vars,
        "messages": normalize_messages(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    try:
        return compiled.render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
