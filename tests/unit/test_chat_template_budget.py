"""A chat template that runs past its time budget stops (in the thread that renders it)
with a ChatTemplateError, instead of spinning on after the request was refused; operations
that would build huge values in one step are refused at once."""

from __future__ import annotations

import threading
import time

import pytest

from actors.tokenizer.chat_template import ChatTemplateError, render_chat, render_time_limit

MESSAGES = [{"role": "user", "content": "hi"}]
# Loops with empty bodies and a precomputed iterable: no call, attribute or item access
# inside the inner loops, ~1e15 iterations.
SPIN = (
    "{% set r = range(100000) %}"
    "{% for a in r %}{% for b in r %}{% for c in r %}{% endfor %}{% endfor %}{% endfor %}"
)


def _render_in_thread(template: str, limit: float, **kw) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run() -> None:
        try:
            with render_time_limit(limit):
                outcome.append(render_chat(template, MESSAGES, bos_token="", eos_token="", **kw))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize(
    "template",
    [
        SPIN,
        "{% macro f(n) %}{% for i in range(100000) %}{{ f(n - 1) if n else '' }}{% endfor %}"
        "{% endmacro %}{{ f(3) }}",
        "{% set ns = namespace(x=0) %}{% for a in range(100000) %}{% for b in range(100000) %}"
        "{% set ns.x = ns.x + 1 %}{% endfor %}{% endfor %}",
    ],
)
def test_a_spinning_template_stops_itself_at_its_budget(template):
    started = time.monotonic()
    thread, outcome = _render_in_thread(template, 0.3)
    thread.join(timeout=10.0)
    assert not thread.is_alive(), "the render thread is still spinning"
    assert time.monotonic() - started < 5.0
    assert isinstance(outcome[0], ChatTemplateError), outcome
    assert "did not render within 0.3 s" in str(outcome[0])


def test_a_client_template_variable_cannot_lift_the_limit():
    # chat_template_kwargs reach render_chat as template variables: none of them may be the
    # time limit. Without render_time_limit the module's RENDER_TIMEOUT_S (5 s) applies.
    thread, outcome = _render_in_thread(SPIN, 0.3, timeout_s=1e9, limit_s=1e9)
    thread.join(timeout=10.0)
    assert not thread.is_alive()
    assert isinstance(outcome[0], ChatTemplateError), outcome


@pytest.mark.parametrize(
    "expression",
    ["9 ** (9 ** 9)", "'x' * 10 ** 9", "[1] * 10 ** 9", "(10 ** 60) ** 100000"],
)
def test_a_single_huge_operation_is_refused_at_once(expression):
    started = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_chat("{{ " + expression + " }}", MESSAGES, bos_token="", eos_token="")
    assert time.monotonic() - started < 2.0


def test_doubling_a_string_in_a_loop_is_refused_before_it_eats_memory():
    template = (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}"
    )
    with pytest.raises(ChatTemplateError):
        render_chat(template, MESSAGES, bos_token="", eos_token="")


def test_ordinary_templates_render_as_a_plain_sandbox_renders_them():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m.content | trim }}"
        "{% if not loop.last %}|{% endif %}{% endfor %}{{ 'x' * 3 }}{{ 2 ** 10 }}"
        "{{ 'a' + 'b' }}{{ 1 ~ '-' ~ messages | length }}"
        "{% for a, b in [(1, 2)] if a %}{{ a + b }}{% else %}none{% endfor %}"
        "{% for i in [] %}{% else %}empty{% endfor %}"
    )
    plain = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    want = plain.from_string(template).render(messages=MESSAGES * 2, bos_token="<s>")
    out = render_chat(template, MESSAGES * 2, bos_token="<s>", eos_token="")
    assert out == want == "<s><user>hi|<user>hixxx1024ab1-23empty"
