"""What a vLLM user's clients send, against the shared server: extra_body fields, echo and
prompt logprobs, logit_bias, the tokenizer endpoints, request ids, CORS, HEAD / OPTIONS,
SSE keep-alives, chat template options."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.e2e.server_fixtures import MODEL_NAME

pytestmark = [pytest.mark.model]

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0
    ) as c:
        yield c


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}",
        json=body,
        headers={**server.auth, **(headers or {})},
        timeout=120,
    )


def test_unknown_extra_body_fields_are_ignored(client, server):
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        extra_body={
            "priority": 3,
            "return_token_ids": True,
            "guided_decoding_backend": "x",
            "top_k": 1,
        },
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert "ignoring unknown request fields" in server.log_tail(200_000)


def test_echo_with_logprobs_equals_hf_log_softmax(client, tokenizer, hf_model):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    lp = choice.logprobs
    ids = tokenizer.encode(PROMPT)
    assert choice.text.startswith(PROMPT)
    n = len(ids)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = ref[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()
    got = lp.token_logprobs[1:n]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # the generated token: its logprob under the last prompt position
    assert abs(lp.token_logprobs[n] - ref[n - 1].max().item()) < 1e-4


def test_vllm_prompt_logprobs_field(server):
    resp = post(
        server,
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 2,
        },
    )
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) > 5
    for entry in plp[1:]:
        ranks = sorted(v["rank"] for v in entry.values())
        assert 1 in ranks or len(entry) == 3  # the token itself, and the top 2


def test_logit_bias_over_http(client, tokenizer):
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0
    )
    first = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={str(first): -100}
    )
    assert not banned.choices[0].text.startswith(plain.choices[0].text[:2])
    forced = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={"1234": 100}
    )
    assert tokenizer.encode(forced.choices[0].text, add_special_tokens=False) == [1234, 1234]


def test_stop_reason_and_stop_token_ids(client, tokenizer):
    out = client.completions.create(
        model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == " 7"
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="1, 2, 3, 4,",
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [comma]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == comma


def test_tokenize_detokenize_version(server, tokenizer):
    resp = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    body = resp.json()
    assert resp.status_code == 200 and body["tokens"] == tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    chat = post(
        server,
        "/tokenize",
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
    ).json()
    assert chat["count"] > 3
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"][1:]})
    assert back.json()["prompt"] == PROMPT
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400
    version = httpx.get(f"{server.base_url}/version")
    assert version.status_code == 200 and version.json()["version"]


def test_tokenize_with_tools_counts_what_chat_prefills(client, server):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": MODEL_NAME, "messages": messages}
    with_tools = post(server, "/tokenize", {**body, "tools": tools}).json()
    without = post(server, "/tokenize", body).json()
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, max_tokens=1, temperature=0
    )
    assert with_tools["count"] == chat.usage.prompt_tokens > without["count"]


def test_request_id_is_echoed_and_names_the_completion(server):
    resp = post(
        server,
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1},
        headers={"X-Request-Id": "abc-1"},
    )
    assert resp.headers["x-request-id"] == "abc-1" and resp.json()["id"] == "cmpl-abc-1"
    fresh = post(
        server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}
    )
    rid = fresh.headers["x-request-id"]
    assert len(rid) >= 16 and fresh.json()["id"] == f"cmpl-{rid}"


def test_head_options_and_cors(server):
    head = httpx.head(f"{server.base_url}/health")
    assert head.status_code == 200 and head.content == b""
    pre = httpx.options(
        f"{server.base_url}/v1/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = httpx.get(f"{server.base_url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert httpx.options(f"{server.base_url}/health").headers["allow"].startswith("GET")


def test_sse_keepalives_do_not_disturb_clients(client, server):
    # The test server sends a comment after 50 ms of silence: every stream carries some.
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=server.auth, timeout=60
    ) as resp:
        lines = list(resp.iter_lines())
    assert any(line.startswith(": keep-alive") for line in lines)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
        )
    )
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert text == plain.choices[0].text


def test_chat_template_options(client, server):
    base = [{"role": "user", "content": "Say a word."}]
    opened = post(server, "/tokenize", {"messages": base, "add_generation_prompt": True}).json()
    closed = post(server, "/tokenize", {"messages": base, "add_generation_prompt": False}).json()
    assert opened["count"] > closed["count"]
    cont = client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=3,
        temperature=0,
        messages=[*base, {"role": "assistant", "content": "The word is"}],
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert cont.choices[0].finish_reason in ("length", "stop")
    bad = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": base, "continue_final_message": True},
    )
    assert bad.status_code == 400  # with add_generation_prompt (the default) it cannot work


def test_model_names_and_a_clipped_unknown_name(server):
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.auth).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    resp = post(server, "/v1/completions", {"model": "x" * 100_000, "prompt": "hi"})
    assert resp.status_code == 404 and len(resp.text) < 2000


def test_streamed_chat_chunks_carry_exactly_their_tokens_text(client):
    """A chunk's text is the text of the tokens whose logprobs it carries (vLLM's
    test_chat_streaming checks this; a held-back last character broke it: "Boo" with the
    logprob of "Book")."""
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Write a sentence about books and libraries."}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    pieces, count = [], 0
    for chunk in stream:
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        choice = chunk.choices[0]
        tokens = "".join(lp.token for lp in choice.logprobs.content)
        count += len(choice.logprobs.content)
        pieces.append((choice.delta.content or "", tokens))
    assert count >= 20  # (a chunk carries several tokens where speculation accepted a run)
    assert all(text == tokens for text, tokens in pieces), pieces


def test_the_eos_that_ends_an_answer_is_not_text(client, tokenizer):
    """With special tokens decoded (skip_special_tokens false, as tool formats whose markers
    are special tokens need), the EOS that ended the answer is still not part of it."""
    eos = tokenizer.tokenizer.token_to_id("<eos>")
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"min_tokens": 2, "logit_bias": {str(eos): 100}, "skip_special_tokens": False},
    )
    choice = out.choices[0]
    # min_tokens keeps the first EOS from ending it (it is text, decoded); the second ends it
    # and is not text.
    assert choice.finish_reason == "stop" and out.usage.completion_tokens == 2
    assert choice.text == "<eos>"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_offsets_point_at_their_tokens_in_the_text(client, tokenizer, stream):
    """With echo and logprobs, text[text_offset[i]:][: len(tokens[i])] == tokens[i] for
    every prompt and output token, special tokens (<bos>, <pad>) included."""
    ids = tokenizer.encode(PROMPT)
    pad = tokenizer.tokenizer.token_to_id("<pad>")
    prompt = [ids[0], pad, *ids[1:]]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    if stream:
        text, tokens, offsets = "", [], []
        for chunk in client.completions.create(**kwargs, echo=True, logprobs=1, stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                text += chunk.choices[0].text
                tokens += chunk.choices[0].logprobs.tokens
                offsets += chunk.choices[0].logprobs.text_offset
    else:
        choice = client.completions.create(**kwargs, echo=True, logprobs=1).choices[0]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    assert "<pad>" in tokens and len(tokens) == len(prompt) + 4
    assert [text[o : o + len(t)] for o, t in zip(offsets, tokens)] == tokens


def test_return_token_ids_completions_and_chat(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 4
    assert tokenizer.tokenizer.decode(choice["token_ids"]) == out.choices[0].text

    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=3,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt_ids = chat.model_dump()["prompt_token_ids"]
    assert len(prompt_ids) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_dump()["token_ids"]) == 3
    streamed = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    dumps = [c.model_dump() for c in streamed]
    assert [d.get("prompt_token_ids") for d in dumps if d.get("prompt_token_ids")] == [prompt_ids]
    tokens = [t for d in dumps for c in d["choices"] for t in c.get("token_ids") or []]
    assert tokens == chat.choices[0].model_dump()["token_ids"]


def test_return_tokens_as_token_ids(client):
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in out.choices[0].model_dump()["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:")
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)


def test_continuous_usage_stats(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    with_text = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in with_text)
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_prompt_logprobs_on_chat(client, server):
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 1,
        "prompt_logprobs": 1,
    }
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    plp = resp.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == resp.json()["usage"]["prompt_tokens"]
    assert all(isinstance(e, dict) and e for e in plp[1:])
    refused = post(server, "/v1/chat/completions", {**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_tokenizer_info(server, tokenizer):
    resp = httpx.get(f"{server.base_url}/tokenizer_info", headers=server.auth)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["bos_token"] == "<bos>" and info["eos_token"] == tokenizer.eos_token
    assert info["vocab_size"] == tokenizer.vocab_size and "start_of_turn" in info["chat_template"]
    assert info["added_tokens_decoder"][str(tokenizer.bos_id)]["content"] == "<bos>"
    # It shows the chat template: behind the API key, as /v1 is.
    assert httpx.get(f"{server.base_url}/tokenizer_info").status_code == 401
