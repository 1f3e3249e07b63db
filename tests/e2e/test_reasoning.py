"""`serve --reasoning-parser NAME` end to end: per parser, a tiny random-weight Llama whose
character-level tokenizer has `<think>` and `</think>` as tokens and whose chat template
follows the parser's convention, served over real HTTP.

- deepseek_r1: the template ends the generation prompt with `<think>\\n` (the output starts
  in reasoning, closed by `</think>`);
- qwen3: the model writes the whole `<think>...</think>` block itself; the template takes
  `enable_thinking=False` (an empty closed block in the prompt: all content) and
  `thinking_in_prompt=True` (opened in the prompt, as Qwen3 2507 thinking templates do).

Random weights say nothing, so the output is constrained into the convention's shape with a
regex (`structured_outputs`): the official `openai` client then reads the thinking in
`reasoning_content` and `reasoning`, the answer in `content`, whole and streamed, and they
are the split of the raw text the same prompt gives on /v1/completions. A constraint on the
answer alone (`choice`) lets reasoning through first. Responses (reasoning items) and
Messages (thinking blocks) give the same split as chat completions.
"""

from __future__ import annotations

import re
import string
from pathlib import Path

import httpx
import openai
import pytest

from actors.reasoning import reasoning_format
from tests.e2e.engine_fixtures import hf_tokenizer, save_tiny_llama
from tests.e2e.server_fixtures import start_server, stop_server

pytestmark = [pytest.mark.model]

CONTROL = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
VOCAB = {t: i for i, t in enumerate([*CONTROL, *CHARS, "<think>", "</think>"])}
THINK_CLOSE_ID = VOCAB["</think>"]

TURNS = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TEMPLATES = {
    # DeepSeek-R1's convention: the prompt opens the reasoning
    "deepseek_r1": TURNS + "{% if add_generation_prompt %}assistant: <think>\n{% endif %}",
    # Qwen3's: the model opens it, unless the template is told otherwise
    "qwen3": TURNS
    + "{% if add_generation_prompt %}assistant:\n"
    + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    + "{% elif thinking_in_prompt is defined and thinking_in_prompt %}<think>\n{% endif %}"
    + "{% endif %}",
}
# The shape each convention's output is held to (the close tag in it: left unwrapped)
SHAPES = {
    "deepseek_r1": "[a-z]{1,6}( [a-z]{1,6}){0,2}\n</think>\n\n(yes|no)",
    "qwen3": "<think>\n[a-z]{1,6}( [a-z]{1,6}){0,2}\n</think>\n\n(yes|no)",
}
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]


def tiny_reasoning_model(root: Path, parser: str) -> Path:
    """A random-weight Llama with a character-level tokenizer (plus the two tags) and the
    parser's chat template, saved as a Hugging Face folder."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    folder = root / f"tiny-{parser}"
    save_tiny_llama(folder, len(VOCAB))
    tok = Tokenizer(BPE(VOCAB, [], unk_token="<unk>"))  # no merges: one token a character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in CONTROL])
    # as in DeepSeek-R1's and Qwen3's tokenizers: added tokens, not special ones (kept in text)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    hf_tok = hf_tokenizer(tok)
    hf_tok.chat_template = TEMPLATES[parser]
    hf_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def served(request, tmp_path_factory):
    parser = request.param
    folder = tiny_reasoning_model(tmp_path_factory.mktemp("models"), parser)
    handle = start_server(
        args=[str(folder), "--max-model-len", "256", "--reasoning-parser", parser],
        env={"KVACTOR_LOG_LEVEL": "info"},
    )
    try:
        with openai.OpenAI(
            base_url=f"{handle.base_url}/v1", api_key=handle.api_key, max_retries=0, timeout=120
        ) as client:
            yield parser, handle, client, folder.name
    finally:
        stop_server(handle)


def _render(parser: str, **kwargs) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(TEMPLATES[parser]).render(
        messages=QUESTION, add_generation_prompt=True, **kwargs
    )


def _raw_text(handle, model: str, prompt: str, body: dict) -> str:
    """The unsplit output of the same prompt, from /v1/completions."""
    resp = httpx.post(
        f"{handle.base_url}/v1/completions",
        headers=handle.auth,
        timeout=120,
        json={"model": model, "prompt": prompt, **body},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _streamed(client, **kwargs) -> tuple[str, str, str, list[str]]:
    """(reasoning_content, reasoning, content, the order of the deltas' kinds)."""
    rc, r, c, order = [], [], [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            rc.append(extra["reasoning_content"])
            order.append("reasoning")
        if extra.get("reasoning"):
            r.append(extra["reasoning"])
        if delta.content:
            c.append(delta.content)
            order.append("content")
    return "".join(rc), "".join(r), "".join(c), order


def _check_whole_and_streamed(client, model: str, kwargs: dict) -> tuple[str, str]:
    out = client.chat.completions.create(model=model, messages=QUESTION, **kwargs)
    message = out.choices[0].message
    extra = message.model_extra or {}
    reasoning, content = extra.get("reasoning_content") or "", message.content or ""
    assert (extra.get("reasoning") or "") == reasoning  # vLLM's newer name, the same text
    rc, r, c, order = _streamed(client, model=model, messages=QUESTION, **kwargs)
    assert (rc, r, c) == (reasoning, reasoning, content)
    assert order == sorted(order, key=lambda kind: kind != "reasoning")  # thinking first
    return reasoning, content


def _regex(shape: str) -> dict:
    return {
        "temperature": 0,
        "max_tokens": 64,
        "extra_body": {"structured_outputs": {"regex": shape}},
    }


def test_constrained_shape_splits_into_reasoning_and_answer(served):
    parser, handle, client, model = served
    shape = SHAPES[parser]
    reasoning, content = _check_whole_and_streamed(client, model, _regex(shape))
    assert re.fullmatch("[a-z]{1,6}( [a-z]{1,6}){0,2}", reasoning), reasoning
    assert content in ("yes", "no")
    prompt = _render(parser)
    body = {"temperature": 0, "max_tokens": 64, "structured_outputs": {"regex": shape}}
    raw = _raw_text(handle, model, prompt, body)
    assert re.fullmatch(shape, raw), raw
    assert "</think>" not in reasoning + content
    assert reasoning_format(parser).split(raw, prompt) == (reasoning, content)


def test_answer_constraint_lets_reasoning_through_first(served):
    """choice [yes, no] constrains the answer only: free text (here favouring </think>,
    so that random weights close it soon) up to </think> comes first."""
    parser, handle, client, model = served
    # qwen3: with the reasoning opened in the prompt (as the 2507 thinking templates do)
    template_kwargs = {"thinking_in_prompt": True} if parser == "qwen3" else {}
    reasoned = 0
    for seed in range(4):
        plain = {
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 48,
            "logit_bias": {str(THINK_CLOSE_ID): 4.0},
        }
        choice = {"choice": ["yes", "no"]}
        extra = {"structured_outputs": choice, "chat_template_kwargs": template_kwargs}
        reasoning, content = _check_whole_and_streamed(
            client, model, {**plain, "extra_body": extra}
        )
        assert content in ("yes", "no"), (reasoning, content)
        reasoned += bool(reasoning)
    assert reasoned >= 1


# The enable_thinking switch is the qwen3 template's: these run on that server only.
@pytest.mark.parametrize("served", ["qwen3"], indirect=True)
def test_a_template_that_closed_the_reasoning_gives_content(served):
    parser, handle, client, model = served
    kwargs = {
        "temperature": 0,
        "max_tokens": 12,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    reasoning, content = _check_whole_and_streamed(client, model, kwargs)
    assert reasoning == "" and content  # whatever the model wrote, nothing of it is thinking


def test_responses_and_messages_split_as_chat_does(served):
    """Greedy and unconstrained: the same tokens as chat completions, split the same."""
    parser, handle, client, model = served
    plain = {"temperature": 0, "max_tokens": 12}
    reasoning, content = _check_whole_and_streamed(client, model, plain)
    # Responses: a reasoning item (when there is reasoning), then the message
    resp = httpx.post(
        f"{handle.base_url}/v1/responses",
        headers=handle.auth,
        timeout=120,
        json={"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": 12},
    )
    assert resp.status_code == 200, resp.text
    items = resp.json()["output"]
    thought = [p["text"] for i in items if i["type"] == "reasoning" for p in i["content"]]
    answer = [p["text"] for i in items if i["type"] == "message" for p in i["content"]]
    assert ("".join(thought), "".join(answer)) == (reasoning, content), items
    if reasoning:
        assert items[0]["type"] == "reasoning"
    # Messages: a thinking block (when there is reasoning), then text; for qwen3 with the
    # reasoning opened in the prompt
    template_kwargs = {"thinking_in_prompt": True} if parser == "qwen3" else {}
    if template_kwargs:
        reasoning, content = _check_whole_and_streamed(
            client, model, {**plain, "extra_body": {"chat_template_kwargs": template_kwargs}}
        )
        assert reasoning
    resp = httpx.post(
        f"{handle.base_url}/v1/messages",
        headers={"x-api-key": handle.api_key, "anthropic-version": "2023-06-01"},
        timeout=120,
        json={
            "model": model,
            "messages": QUESTION,
            "temperature": 0,
            "max_tokens": 12,
            "chat_template_kwargs": template_kwargs,
        },
    )
    assert resp.status_code == 200, resp.text
    blocks = resp.json()["content"]
    thought = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    answer = [b["text"] for b in blocks if b["type"] == "text"]
    assert ("".join(thought), "".join(answer)) == (reasoning, content), blocks
    if reasoning:
        assert blocks[0]["type"] == "thinking"


def test_the_parser_name_is_checked_at_start(tmp_path):
    folder = tiny_reasoning_model(tmp_path, "qwen3")
    with pytest.raises(RuntimeError, match="reasoning parser.*deepseek_r1"):
        handle = start_server(args=[str(folder), "--reasoning-parser", "granite"])
        stop_server(handle, check=False)


@pytest.mark.parametrize("served", ["qwen3"], indirect=True)
def test_a_closed_reasoning_holds_the_answer_to_its_constraint_from_the_start(served):
    """The grammar is built knowing the rendered prompt: where the template closed the
    reasoning (qwen3, thinking disabled) the answer is constrained from its first token,
    not left free in case a `</think>` comes."""
    parser, handle, client, model = served
    for seed in range(3):
        kwargs = {
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 24,
            "extra_body": {
                "structured_outputs": {"choice": ["yes", "no"]},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        }
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "ok?"}], **kwargs
        )
        choice = out.choices[0]
        assert choice.message.content in ("yes", "no"), choice.message
        assert choice.finish_reason == "stop" and not choice.message.reasoning_content
