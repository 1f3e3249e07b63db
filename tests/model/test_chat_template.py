"""render_chat against Hugging Face's apply_chat_template, and its checks on messages."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from actors.tokenizer.chat_template import ChatTemplateError, normalize_messages, render_chat
from kernels.tokenizer_loader import GEMMA3_CHAT_TEMPLATE, load_tokenizer

BOS, EOS = "<bos>", "<eos>"


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerFast:
    """A tokenizer whose only job is to carry the special tokens HF hands to the template."""
    vocab = {"<pad>": 0, EOS: 1, BOS: 2, "<unk>": 3}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
        bos_token=BOS,
        eos_token=EOS,
        unk_token="<unk>",
        pad_token="<pad>",
    )


def hf_render(hf: PreTrainedTokenizerFast, template: str, messages: list[dict], **kw: Any) -> str:
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)


CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Name a color.\n"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Écris un haïku sur la mer 🌊, s'il te plaît."},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Answer in Japanese."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "４です。"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "６です。"},
    ],
    "single_text_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": " Tell me a joke. "}]},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_template_equals_hf(
    hf: PreTrainedTokenizerFast, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = render_chat(
        GEMMA3_CHAT_TEMPLATE, messages, add_generation_prompt, bos_token=BOS, eos_token=EOS
    )
    theirs = hf_render(
        hf, GEMMA3_CHAT_TEMPLATE, messages, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_embedded_model_prompt_tokenizes_with_one_bos() -> None:
    bundle = load_tokenizer()  # the embedded model's tokenizer and chat template
    assert bundle.chat_template is not None
    messages = CONVERSATIONS["system_multi_turn"][:3]
    text = render_chat(
        bundle.chat_template, messages, bos_token=bundle.bos_token, eos_token=bundle.eos_token
    )
    ids = bundle.encode(text, add_special_tokens=False)
    start_of_turn = bundle.tokenizer.token_to_id("<start_of_turn>")
    end_of_turn = bundle.tokenizer.token_to_id("<end_of_turn>")
    assert ids[:2] == [bundle.bos_id, start_of_turn] and ids.count(bundle.bos_id) == 1
    assert ids.count(start_of_turn) == 3 and ids.count(end_of_turn) == 2
    assert bundle.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_gemma_rendering_by_hand() -> None:
    messages = CONVERSATIONS["system_multi_turn"][:3]
    assert render_chat(GEMMA3_CHAT_TEMPLATE, messages, bos_token=BOS, eos_token=EOS) == (
        "<bos><start_of_turn>user\nAnswer in Japanese.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n４です。<end_of_turn>\n<start_of_turn>model\n"
    )


# A ChatML-style template with plain `{% %}` tags (trim_blocks/lstrip_blocks matter), namespace,
# loop controls, tojson on non-ASCII text, and the generation block.
CHATML_LIKE = """{% set ns = namespace(n_user=0) %}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% if message['role'] == 'user' %}{% set ns.n_user = ns.n_user + 1 %}{% endif %}
    <|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{% endgeneration %}
    {% else %}
{{ message['content'] }}
    {% endif %}
<|im_end|>
{% endfor %}
{% if tools %}{{ tools | tojson }}
{% endif %}
users={{ ns.n_user }}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_environment_matches_hf_on_a_block_template(hf: PreTrainedTokenizerFast, name: str) -> None:
    messages = [m for m in CONVERSATIONS[name] if isinstance(m["content"], str)]
    messages = messages + [{"role": "tool", "content": "ignored"}]
    tools = [{"name": "météo", "params": {"ville": "Zürich"}}]
    ours = render_chat(CHATML_LIKE, messages, bos_token=BOS, eos_token=EOS, tools=tools)
    assert ours == hf_render(hf, CHATML_LIKE, messages, add_generation_prompt=True, tools=tools)
    assert '"météo"' in ours and "<|im_start|>" in ours


def test_text_parts_are_flattened() -> None:
    parts = [{"type": "text", "text": "First line."}, {"type": "text", "text": "Second line."}]
    flat = [{"role": "user", "content": "First line.\nSecond line."}]
    assert render_chat(
        GEMMA3_CHAT_TEMPLATE, [{"role": "user", "content": parts}], bos_token=BOS, eos_token=EOS
    ) == render_chat(GEMMA3_CHAT_TEMPLATE, flat, bos_token=BOS, eos_token=EOS)


def test_developer_role_is_system_and_none_fields_are_dropped() -> None:
    messages = [
        {"role": "developer", "content": "Be brief.", "name": None},
        {"role": "user", "content": "Hi", "name": "ana"},
    ]
    assert normalize_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ana"},
    ]
    rendered = render_chat(GEMMA3_CHAT_TEMPLATE, messages, bos_token=BOS, eos_token=EOS)
    assert rendered.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi")


def test_callers_messages_are_not_changed() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [{"role": "user", "content": parts}]
    before = copy.deepcopy(messages)
    render_chat(GEMMA3_CHAT_TEMPLATE, messages, bos_token=BOS, eos_token=EOS)
    assert messages == before


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "must not be empty"),
        ("hello", "list of message objects"),
        (["hello"], "messages[0] must be an object"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role must be one of"),
        ([{"role": 3, "content": "x"}], "messages[0].role must be one of"),
        ([{"content": "x"}], "messages[0].role must be one of"),
        ([{"role": "user"}], "messages[0].content is missing"),
        ([{"role": "user", "content": None}], "messages[0].content is missing"),
        ([{"role": "user", "content": 42}], "must be a string or a list of text parts; got int"),
        ([{"role": "user", "content": {"text": "x"}}], "got dict"),
        ([{"role": "user", "content": []}], "must not be an empty list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]: only text parts are supported; got 'image_url'",
        ),
        ([{"role": "user", "content": ["plain"]}], "only text parts are supported; got 'str'"),
        ([{"role": "user", "content": [{"type": "text"}]}], "content[0].text must be a string"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "Conversation roles must alternate",
        ),
        ([{"role": "assistant", "content": "I start"}], "Conversation roles must alternate"),
    ],
)
def test_invalid_messages_raise_value_error(messages: Any, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        render_chat(GEMMA3_CHAT_TEMPLATE, messages, bos_token=BOS, eos_token=EOS)
    assert isinstance(info.value, ChatTemplateError)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set _ = messages.append({'role': 'user'}) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_escapes_and_mutation(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(template, [{"role": "user", "content": "x"}], bos_token=BOS, eos_token=EOS)


def test_broken_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat(
            "{% for m in messages %}",
            [{"role": "user", "content": "x"}],
            bos_token=BOS,
            eos_token=EOS,
        )
