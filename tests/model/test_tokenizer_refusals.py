"""The tokenizer actor refuses what it cannot serve with a clear error, cheaply, and keeps
serving: every kind of chat-template failure (not only jinja's own errors) is a bad
request, a template that renders too long is cut off, and an oversized prompt is refused
by its character count before it is tokenized."""

from __future__ import annotations

import anyio
import pytest

from actors.runtime import ActorSpec, ActorSystem, RemoteError
from actors.tokenizer.validation import ERR_CONTEXT_LENGTH, ERR_INVALID_REQUEST
from tests.actors.probe_actors import ProbeActor
from transport.messages.control import Pong
from transport.messages.engine import (
    ChatMessage,
    GenerateRequest,
    GenerationParams,
    TokenizeReply,
    TokenizeRequest,
)

pytestmark = [pytest.mark.model]

HOSTILE_TEMPLATES = {
    "ZeroDivisionError": "{{ 1 // 0 }}",
    "OverflowError": "{% for i in range(10**9) %}{% endfor %}",  # the sandbox's range cap
    "RecursionError": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "no loader": "{% include 'other.jinja' %}",
    "undefined call": "{{ nothing() }}",
}
# About 64 million loop steps: seconds of rendering (the abandoned thread ends on its own).
SLOW_TEMPLATE = (
    "{% for i in range(400) %}{% for j in range(400) %}{% for k in range(400) %}"
    "{% endfor %}{% endfor %}{% endfor %}x"
)


async def _tokenizer(template: str, **kw):
    spec = ActorSpec(
        "tokenizer",
        "actors.tokenizer.actor:TokenizerActor",
        dict(context_len=512, chat_template=template, **kw),
    )
    # The scheduler is never reached here: a probe stands in for it.
    specs = [spec, ActorSpec("scheduler", ProbeActor)]
    return ActorSystem(specs, transport="inproc", start_timeout_s=120)


def _chat() -> TokenizeRequest:
    return TokenizeRequest(messages=[ChatMessage(role="user", content="hi")])


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_every_template_failure_is_a_bad_request(name):
    async def go():
        async with await _tokenizer(HOSTILE_TEMPLATES[name]) as system:
            tok = system.ref("tokenizer")
            with pytest.raises(RemoteError) as err:
                await tok.call(_chat(), expect=TokenizeReply, timeout=30)
            assert err.value.reply.code == ERR_INVALID_REQUEST, err.value.reply
            assert err.value.reply.message.startswith("messages:"), err.value.reply
            # Still serving: a plain prompt tokenizes.
            reply = await tok.call(TokenizeRequest(prompt="hello"), expect=TokenizeReply)
            assert reply.tokens

    anyio.run(go)


def test_a_slow_template_is_cut_off_and_pings_are_answered_meanwhile():
    async def go():
        # The limit leaves the pings room: the render thread holds the GIL between its ticks,
        # so on a loaded machine a round trip on the event loop can take tens of ms.
        async with await _tokenizer(SLOW_TEMPLATE, template_timeout_s=2.0) as system:
            tok = system.ref("tokenizer")
            pongs: list[Pong] = []

            async def ping_while_rendering() -> None:
                for _ in range(3):
                    await anyio.sleep(0.05)
                    pongs.append(await tok.ping(timeout=1.0))

            async with anyio.create_task_group() as tg:
                tg.start_soon(ping_while_rendering)
                with pytest.raises(RemoteError) as err:
                    await tok.call(_chat(), expect=TokenizeReply, timeout=30)
            assert "did not render within 2 s" in err.value.reply.message
            assert len(pongs) == 3 and all(p.busy_s > 0 for p in pongs)  # busy, not down

    anyio.run(go)


def test_an_oversized_prompt_is_refused_by_its_length_before_tokenizing():
    async def go():
        async with await _tokenizer("") as system:
            tok = system.ref("tokenizer")
            request = GenerateRequest(
                client_rid="big",
                reply_to="nobody",
                params=GenerationParams(max_tokens=4),
                prompt="word " * 400_000,  # 2 MB
            )
            with pytest.raises(RemoteError) as err:
                await tok.call(request, timeout=30)
            assert err.value.reply.code == ERR_CONTEXT_LENGTH  # too long: its own code
            assert "characters" in err.value.reply.message, err.value.reply

    anyio.run(go)
