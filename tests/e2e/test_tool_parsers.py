"""One server per tool-call format: a tiny random-weight Llama with a character-level
tokenizer, a chat template in that format (`--tool-call-parser auto` must pick it, and says
so in its log), and `tool_choice` named or required, so the constrained output has to be
that format's calls; the official `openai` client must get them back as `tool_calls`,
whole and streamed, with arguments valid against the tool's schema."""

from __future__ import annotations

import json
import string
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.e2e.engine_fixtures import hf_tokenizer, save_tiny_llama
from tests.e2e.server_fixtures import start_server, stop_server

pytestmark = [pytest.mark.model]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

_TURNS = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# A template per format, showing the markers `auto` recognizes.
TEMPLATES = {
    "hermes": "{% if tools %}<tools>{{ tools | tojson }}</tools> reply in <tool_call></tool_call>"
    "\n{% endif %}" + _TURNS,
    "llama3_json": "{% if tools %}{{ tools | tojson }} reply as JSON after <|python_tag|>\n"
    "{% endif %}" + _TURNS,
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] reply"
    " with [TOOL_CALLS]\n{% endif %}" + _TURNS,
    "pythonic": "{% if tools %}{{ tools | tojson }} reply as [func_name1(params_name1="
    "params_value1)]\n{% endif %}" + _TURNS,
    "qwen3_coder": "{% if tools %}<tools>{{ tools | tojson }}</tools> reply with <tool_call>"
    "<function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>\n{% endif %}" + _TURNS,
}


def tiny_char_llama(root: Path) -> Path:
    """A random-weight Llama whose tokens are single characters, so any text is spelled."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    folder = root / "tiny-char-llama"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in string.printable:
        if c not in "\t\r\x0b\x0c":
            vocab[c] = len(vocab)
    save_tiny_llama(folder, len(vocab), max_position_embeddings=4096)
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    hf_tok = hf_tokenizer(tok)
    hf_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_char_llama(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, model_folder, tmp_path_factory):
    fmt = request.param
    template = tmp_path_factory.mktemp("templates") / f"{fmt}.jinja"
    template.write_text(TEMPLATES[fmt])
    handle = start_server(
        args=[str(model_folder), "--max-model-len", "4096", "--chat-template", str(template)],
        extra=["server.tool_call_parser=auto", "kv.context_len=4096"],
        env={"KVACTOR_LOG_LEVEL": "info"},
    )
    try:
        client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key=handle.api_key)
        yield fmt, handle, client, model_folder
    finally:
        stop_server(handle)


def check_calls(calls, names: set[str]) -> list[tuple[str, str]]:
    assert calls
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


def test_auto_picked_the_templates_format(served):
    fmt, handle, _, _ = served
    line = next(ln for ln in handle.log_tail(200_000).splitlines() if "tool_call_format" in ln)
    assert fmt in line and "from the chat template" in line, line


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_constrained_calls_come_back_as_tool_calls(served, tool_choice):
    fmt, _, client, folder = served
    names = {"get_weather"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    body = dict(
        model=str(folder),
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0.7,
        seed=3,
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls", (fmt, choice.message)
    assert not choice.message.content
    calls = check_calls(choice.message.tool_calls, names)
    assert len(calls) == 1
    # Streamed: the same call, in deltas.
    name, args, finish = None, "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                name = d.function.name or name
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(name, args)] == calls
