"""`bin/engine serve some-model.gguf` for the Llama family, as a llama.cpp user runs it: a
Qwen2 GGUF in 4-bit blocks kept quantized by default (`model.quantization = "auto"`), and a
Llama 2 / Mistral-style GGUF (sentencepiece vocabulary) run exact, both answering chat
through the GGUF's own chat template and completions, with the official `openai` client."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI

from kernels.models import load_model
from kernels.tokenizer_loader import load_tokenizer
from tests.e2e.server_fixtures import start_server, stop_server
from tests.model.gguf_fixtures import write_foreign_gguf, write_tiny_gguf
from tests.model.model_fixtures import GreedyRunner, make_executor

pytestmark = [pytest.mark.model]

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour of the sea."},
]


def _serve(path, *flags: str):
    return start_server(
        args=[str(path), "--max-model-len", "512", *flags],
        extra=["kv.num_pages=96", "model.dtype=float32"],
        env={"KVACTOR_LOG_LEVEL": "info"},
    )


@pytest.fixture(scope="module")
def qwen2_q4k(tmp_path_factory):
    info = write_tiny_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny-qwen2-Q4_K.gguf", "qwen2", "Q4_K", save_hf=False
    )
    server = _serve(info["gguf_path"])  # quantization left at its default, auto
    try:
        yield server, info
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def mistral_q8(tmp_path_factory):
    info = write_tiny_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny-mistral-Q8_0.gguf",
        "llama",
        "Q8_0",
        tokenizer="spm",
        save_hf=False,
    )
    server = _serve(info["gguf_path"], "--quantization", "none")
    try:
        yield server, info
    finally:
        stop_server(server)


def _client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, timeout=60)


def test_a_4_bit_gguf_is_served_kept_quantized(qwen2_q4k):
    server, info = qwen2_q4k
    log = server.log_path.read_text()
    assert '"quantization": "gguf"' in log and "stays quantized" in log, log[-3000:]
    client = _client(server)
    names = [m.id for m in client.models.list().data]
    assert names == [str(info["gguf_path"]), "tiny-qwen2-Q4_K"]
    chat = client.chat.completions.create(
        model="tiny-qwen2-Q4_K", messages=CHAT, max_tokens=12, temperature=0
    )
    tokenizer = load_tokenizer(info["gguf_path"])
    # the GGUF's ChatML template rendered the prompt
    assert chat.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    assert "<|im_start|>assistant" in tokenizer.render_chat(CHAT)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens >= 1
    completion = client.completions.create(
        model="tiny-qwen2-Q4_K",
        prompt="The sea is",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage.completion_tokens == 8 and completion.choices[0].text


def test_an_exact_gguf_is_served_token_for_token_as_loaded_offline(mistral_q8):
    """The served model is the file's: its greedy tokens equal kvactor's own executor on
    the same GGUF (exact fp32), and the Mistral [INST] template shapes the chat prompt."""
    server, info = mistral_q8
    assert '"quantization": "none"' in server.log_path.read_text()
    client = _client(server)
    tokenizer = load_tokenizer(info["gguf_path"])
    prompt = "the sea and the sky"
    served = client.completions.create(
        model="tiny-mistral-Q8_0",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = tokenizer.encode(prompt)
    config, model = load_model(info["gguf_path"], torch.float32)
    executor, slots = make_executor(config, model, 1, 64)
    (offline,) = GreedyRunner(executor, slots).generate([ids], 10)
    assert served.choices[0].token_ids == offline
    chat = client.chat.completions.create(
        model="tiny-mistral-Q8_0", messages=CHAT, max_tokens=4, temperature=0
    )
    rendered = tokenizer.render_chat(CHAT)
    assert rendered.startswith("<s>[INST] You answer briefly.")
    assert chat.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))


def test_a_qwen3_gguf_answers_chat_with_its_template(tmp_path):
    """Qwen3 (q/k norms, head_dim 128) in llama.cpp's Q4_K_M mix: int4 and int8 linears."""
    info = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3", "Q4_K_M", save_hf=False)
    server = _serve(info["gguf_path"])
    try:
        client = _client(server)
        chat = client.chat.completions.create(
            model="tiny-qwen3", messages=CHAT, max_tokens=6, temperature=0
        )
        tokenizer = load_tokenizer(info["gguf_path"])
        assert chat.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
        assert chat.usage.completion_tokens >= 1
        assert '"quantization": "gguf"' in server.log_path.read_text()
    finally:
        stop_server(server)


def test_an_unsupported_gguf_fails_at_start_naming_it(tmp_path):
    import subprocess
    import sys

    from tests.e2e.server_fixtures import ROOT

    path = write_foreign_gguf(tmp_path / "phi.gguf")
    res = subprocess.run(
        [sys.executable, "-m", "actors.app.cli", "serve", str(path), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert "GGUF architecture 'phi3' is not supported; supported: gemma3, llama" in res.stderr
    assert "Traceback" not in res.stderr


def test_the_ggufs_end_of_turn_token_ends_a_chat(qwen2_q4k):
    """The end-of-generation ids come from the GGUF: forcing ChatML's <|im_end|> (a
    logit_bias on it) ends the answer at once, with finish_reason stop."""
    server, info = qwen2_q4k
    im_end = info["vocab"]["tokens"].index("<|im_end|>")
    chat = _client(server).chat.completions.create(
        model="tiny-qwen2-Q4_K",
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        logit_bias={str(im_end): 100},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == ""
    assert chat.usage.completion_tokens == 1


def test_a_llama3_gguf_answers_with_its_template_and_stops_at_eot(tmp_path):
    """Llama 3's byte-level BPE vocabulary, header tokens and <|eot_id|>; Q8_0 kept int8."""
    info = write_tiny_gguf(tmp_path / "tiny-llama3.gguf", "llama", "Q8_0", save_hf=False)
    server = _serve(info["gguf_path"])
    try:
        client = _client(server)
        tokenizer = load_tokenizer(info["gguf_path"])
        assert tokenizer.render_chat(CHAT).startswith("<|begin_of_text|><|start_header_id|>")
        eot = info["vocab"]["tokens"].index("<|eot_id|>")
        chat = client.chat.completions.create(
            model="tiny-llama3", messages=CHAT, max_tokens=8, temperature=0
        )
        assert chat.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
        assert chat.usage.completion_tokens >= 1
        stopped = client.chat.completions.create(
            model="tiny-llama3",
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            logit_bias={str(eot): 100},
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage.completion_tokens == 1
        completion = client.completions.create(
            model="tiny-llama3", prompt="the sea", max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert completion.usage.completion_tokens == 5
    finally:
        stop_server(server)
