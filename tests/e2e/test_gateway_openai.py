"""The HTTP gateway through the official `openai` client, against a real server process.

Completions and chat, streamed and not, stop sequences, n > 1, seeds, logprobs, usage
with cached prompt tokens, /v1/models, /health, /metrics and the API key.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import anyio
import httpx
import openai
import pytest

from actors.app.serving import ServingEngine
from actors.app.specs import serving_specs
from actors.runtime import ActorSpec
from tests.e2e.engine_fixtures import natural_text, small_config
from tests.e2e.server_fixtures import (
    MODEL_NAME,
    NUM_PAGES,
    PAGE_SIZE,
    ROOT,
    scrape_metrics,
    wait_idle,
)
from transport.address import pick_free_tcp_port
from transport.client import KvactorClient
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.model]

PROMPT = "Count: 1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120.0
    ) as c:
        yield c


@pytest.fixture(autouse=True)
def system_idle_after(server):
    yield
    figures, _ = wait_idle(server)
    assert figures['kvactor:kv_pages{state="held"}'] == 0


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    health = httpx.get(f"{server.base_url}/health")  # open without a key
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert {"tokenizer", "scheduler", "allocator", "runner"} <= set(health.json()["actors"])


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.model == MODEL_NAME and len(full.choices) == 1
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    assert full.usage.prompt_tokens > 5

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 8
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_token_id_prompt_and_prompt_batch(client):
    by_text = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0
    )
    batch = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Hello, my name is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 8
    # Token ids: the same prompt, tokenized by the chat-free path (BOS included).
    from kernels.tokenizer_loader import load_tokenizer

    ids = load_tokenizer(None).encode(PROMPT)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."},
    ]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 6

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert all(c.choices[0].delta.role is None for c in content[1:])
    assert "".join(c.choices[0].delta.content or "" for c in content) == msg.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_text_parts_render_like_a_string(client):
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
    )
    parts = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        max_tokens=4,
        temperature=0,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_stop_sequences(client):
    full = (
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    assert " 8," in full, full
    cut = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[" 8,", "never-there"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(" 8,")]
    streamed = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=" 8,", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seed_reproducibility(client):
    kwargs = dict(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=1234, n=2
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 12
    # Choice i runs with seed + i: choice 1 of seed s is choice 0 of seed s + 1.
    shifted = client.completions.create(**{**kwargs, "seed": 1235, "n": 1})
    assert shifted.choices[0].text == first.choices[1].text

    chat = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            n=2,
            temperature=0,
            stream=True,
        )
    )
    roles = [c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = [c.choices[0].index for c in chat if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_usage_reports_cached_prompt_tokens(client):
    text = natural_text()
    prompt = text[5000:8000]  # several hundred tokens, unused by other tests
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 300
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole pages of the prompt, at least one token left to compute.
    assert cached % PAGE_SIZE == 0 and n - 2 * PAGE_SIZE <= cached < n, (cached, n)
    assert second.choices[0].text == first.choices[0].text


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0 and 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert top[chosen] == pytest.approx(max(top.values()), abs=1e-4)
        assert value == pytest.approx(top[chosen], abs=1e-4)

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0.0
        assert bytes(item.bytes).decode() == item.token


def test_completion_top_logprobs_always_hold_the_chosen_token(client):
    """As OpenAI's: `logprobs=0` gives the chosen token alone per position, and a sampled
    token outside the top k is listed beside them."""
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == 4
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == pytest.approx({chosen: value})
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=7, logprobs=1
    )
    lp = out.choices[0].logprobs
    outside_top_1 = 0
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[chosen] == pytest.approx(value, abs=1e-4) and 1 <= len(top) <= 2
        outside_top_1 += len(top) == 2
    assert outside_top_1 > 0  # at temperature 1.5 some draws are not the most likely token


def test_metrics_content(client, server):
    before = scrape_metrics(server)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    after = scrape_metrics(server)
    success = 'kvactor:requests_total{outcome="success"}'
    assert after[success] == before[success] + 1
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 3
    assert after["vllm:time_to_first_token_seconds_count"] == (
        before["vllm:time_to_first_token_seconds_count"] + 1
    )
    assert after["vllm:inter_token_latency_seconds_count"] >= (
        before["vllm:inter_token_latency_seconds_count"] + 2
    )
    assert after['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert after['kvactor:kv_pages{state="total"}'] == NUM_PAGES
    pages = [after[f'kvactor:kv_pages{{state="{s}"}}'] for s in ("free", "tree", "held", "session")]
    assert sum(pages) == NUM_PAGES
    assert after["kvactor:kv_cache_hit_tokens_total"] >= 0
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "kvactor:scheduler_retractions_total",
        'kvactor:engine_stats_up{source="scheduler"}',
    ):
        assert after[name] >= 0
    bucket = 'vllm:time_to_first_token_seconds_bucket{le="+Inf"}'
    assert after[bucket] == after["vllm:time_to_first_token_seconds_count"]


# Every series /metrics carries: the ones vLLM exports under vLLM's names (what dashboards
# read), kvactor's own under kvactor:; each with model_name (scrape_metrics checks it).
VLLM_SERIES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    'vllm:request_success_total{finished_reason="length"}',
    'vllm:request_success_total{finished_reason="stop"}',
    *(
        f"vllm:{h}_{part}"
        for h in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
            "request_inference_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_params_n",
            "request_params_max_tokens",
            "iteration_tokens_total",
        )
        for part in ("count", "sum")
    ),
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    # its labels in the order the exposition writes them (sorted)
    f'vllm:cache_config_info{{block_size="{PAGE_SIZE}",cache_dtype="float32",'
    f'enable_prefix_caching="True",num_gpu_blocks="{NUM_PAGES}"}}',
]
SERIES = [
    *VLLM_SERIES,
    *(f'kvactor:requests_total{{outcome="{o}"}}' for o in ("success", "error", "aborted")),
    'vllm:request_success_total{finished_reason="length"}',
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_hits_total",
    'kvactor:engine_stats_up{source="scheduler"}',
    'kvactor:engine_stats_up{source="allocator"}',
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "kvactor:num_requests_prefilling",
    "kvactor:scheduler_steps_total",
    "kvactor:runner_busy_seconds_total",
    "kvactor:scheduler_retractions_total",
    "kvactor:scheduler_prompt_tokens_total",
    "kvactor:scheduler_generated_tokens_total",
    *(
        f'kvactor:kv_pages{{state="{s}"}}'
        for s in ("total", "free", "tree", "held", "session", "evictable")
    ),
    "kvactor:kv_request_records",
    "kvactor:kv_held_rows",
    "kvactor:kv_cache_hit_tokens_total",
    "kvactor:kv_evicted_pages_total",
    "kvactor:kv_retractions_total",
    "kvactor:kv_aborted_total",
    "kvactor:kv_idle_checks_total",  # added with the always-on idle check
    "kvactor:kv_idle_check_failures_total",
]


def test_metrics_carry_every_series_and_process_metrics(client, server):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    metrics = scrape_metrics(server)
    missing = [name for name in SERIES if name not in metrics]
    assert not missing, f"series missing from /metrics: {missing}"
    assert metrics['kvactor:engine_stats_up{source="allocator"}'] == 1
    assert metrics["kvactor:scheduler_steps_total"] >= 2
    assert metrics["process_resident_memory_bytes"] > 0  # from prometheus_client itself
    assert metrics["kvactor:kv_idle_checks_total"] >= 1  # the engine has been idle
    assert metrics["kvactor:kv_idle_check_failures_total"] == 0
    # sensible values after a few requests
    assert metrics["vllm:request_prompt_tokens_count"] >= 1
    assert metrics["vllm:request_generation_tokens_sum"] >= 2
    assert metrics["vllm:request_queue_time_seconds_count"] >= 1
    assert 0 <= metrics["vllm:kv_cache_usage_perc"] <= 1
    assert metrics["vllm:prefix_cache_queries_total"] >= metrics["vllm:prefix_cache_hits_total"]
    assert metrics["vllm:prompt_tokens_total"] == metrics["vllm:prefix_cache_queries_total"]


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before[name]


def test_request_params_n_and_max_tokens(client, server):
    """n once per prompt whose choices all finished; max_tokens once per choice (vLLM
    observes it per finished engine request, and n > 1 is n engine requests)."""
    before = scrape_metrics(server)
    client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=7
    )
    after = scrape_metrics(server)
    assert _delta(before, after, "vllm:request_params_n_count") == 1
    assert _delta(before, after, "vllm:request_params_n_sum") == 2
    assert _delta(before, after, 'vllm:request_params_n_bucket{le="1.0"}') == 0
    assert _delta(before, after, 'vllm:request_params_n_bucket{le="2.0"}') == 1
    assert _delta(before, after, "vllm:request_params_max_tokens_count") == 2
    assert _delta(before, after, "vllm:request_params_max_tokens_sum") == 10
    assert _delta(before, after, 'vllm:request_params_max_tokens_bucket{le="5.0"}') == 2
    assert _delta(before, after, 'vllm:request_params_max_tokens_bucket{le="2.0"}') == 0


def test_request_prefill_decode_and_inference_times(client, server):
    """prefill: admission to the first token (TTFT less the queue time); decode: first
    token to last; inference: their sum. One request moves each by one observation."""
    before = scrape_metrics(server)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 4
    after = scrape_metrics(server)
    d = {
        phase: (
            _delta(before, after, f"vllm:request_{phase}_time_seconds_count"),
            _delta(before, after, f"vllm:request_{phase}_time_seconds_sum"),
        )
        for phase in ("prefill", "decode", "inference", "queue")
    }
    assert all(count == 1 for count, _ in d.values()), d
    (_, prefill), (_, decode), (_, inference), (_, queue) = (
        d[p] for p in ("prefill", "decode", "inference", "queue")
    )
    ttft = _delta(before, after, "vllm:time_to_first_token_seconds_sum")
    e2e = _delta(before, after, "vllm:e2e_request_latency_seconds_sum")
    assert prefill > 0 and decode > 0  # 4 tokens come in 4 steps
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert prefill == pytest.approx(ttft - queue, abs=1e-6)
    assert queue + inference <= e2e + 1e-6


def test_iteration_tokens_histogram_counts_every_step(client, server):
    """vllm:iteration_tokens_total: one observation per engine step, of the prompt tokens
    it prefilled plus one per decoding request."""
    started = time.monotonic()
    before = scrape_metrics(server)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="Iteration tokens: a prompt no other test sends, 7 8 9",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3
    after = scrape_metrics(server)
    steps = _delta(before, after, "kvactor:scheduler_steps_total")
    prefilled = _delta(before, after, "kvactor:scheduler_prompt_tokens_total")
    assert steps >= 3 and prefilled > 1
    # the runner computed those steps, within the time between the scrapes
    busy = _delta(before, after, "kvactor:runner_busy_seconds_total")
    assert 0 < busy < time.monotonic() - started
    assert _delta(before, after, "vllm:iteration_tokens_total_count") == steps
    # the first token comes with the prompt's last chunk; the other two take a step each
    assert _delta(before, after, "vllm:iteration_tokens_total_sum") == prefilled + 2
    assert _delta(before, after, 'vllm:iteration_tokens_total_bucket{le="1.0"}') == 2
    assert (
        after['vllm:iteration_tokens_total_bucket{le="+Inf"}']
        == (after["vllm:iteration_tokens_total_count"])
    )
    assert (
        after['vllm:iteration_tokens_total_bucket{le="16384.0"}']
        <= (after["vllm:iteration_tokens_total_count"])
    )


def test_num_preemptions_are_the_scheduler_retractions(server):
    metrics = scrape_metrics(server)
    assert metrics["vllm:num_preemptions_total"] == metrics["kvactor:scheduler_retractions_total"]


def test_cache_config_info_names_the_kv_cache(server):
    metrics = scrape_metrics(server)
    [(key, value)] = [(k, v) for k, v in metrics.items() if k.startswith("vllm:cache_config_info")]
    assert value == 1
    labels = dict(part.split("=", 1) for part in key[key.index("{") + 1 : -1].split(","))
    assert labels == {
        "block_size": f'"{PAGE_SIZE}"',
        "num_gpu_blocks": f'"{NUM_PAGES}"',
        "enable_prefix_caching": '"True"',
        "cache_dtype": '"float32"',  # the server's model.dtype
    }


def test_memory_plan_gauges_report_weights_kv_pool_and_memory(server):
    """The shared server's plan (fp32, aten linears, 512 pages of 16 tokens and a sliding
    pool as large) at start, as kvactor:memory_* gauges."""
    import torch

    from kernels.memory_plan import kv_pool_bytes, weight_bytes
    from kernels.models import load_config

    metrics = scrape_metrics(server)
    model = load_config(None)
    on_cpu = not torch.cuda.is_available()
    weights = weight_bytes(model, 4, linear="aten", lm_head_onednn=on_cpu).total
    assert metrics["kvactor:memory_weights_bytes"] == weights
    assert metrics["kvactor:memory_kv_pool_bytes"] == kv_pool_bytes(
        model, 4, PAGE_SIZE, NUM_PAGES, NUM_PAGES
    )
    assert (
        metrics["kvactor:memory_available_bytes"]
        > weights + (metrics["kvactor:memory_kv_pool_bytes"])
    )


def test_an_impossible_memory_budget_is_refused_before_any_actor_starts():
    """1 MiB of KV cannot hold one 2048-token request: the engine and `bin/engine serve`
    refuse at start, naming the figures and what to change."""
    from actors.app import cli
    from actors.app.config import ConfigError

    cfg = small_config(kv__memory_bytes=1 << 20)
    with pytest.raises(ConfigError) as info:
        ServingEngine(cfg)
    text = str(info.value)
    assert "kv.memory_bytes = 1048576" in text and "kv.context_len = 2048" in text
    assert "raise kv.memory_bytes" in text and "--max-model-len" in text
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--set", "kv.memory_bytes=1048576", "--max-model-len", "2048"])
    assert str(exited.value.code).startswith("bin/engine: memory plan: kv.memory_bytes")


def test_api_key_is_required(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    missing = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT}
    )
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200  # open by design


def test_ports_in_use_crash_the_server_loudly(server):
    """A second server on the running one's HTTP port, and one on its ZeroMQ address."""
    http_port = server.base_url.rsplit(":", 1)[1]
    free = str(pick_free_tcp_port())
    base = [sys.executable, "-m", "actors.app.cli", "serve", "--set", "kv.num_pages=64"]
    runs = [
        subprocess.Popen(
            [*base, "--port", http_port],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        subprocess.Popen(
            [*base, "--port", free, "--zmq", server.zmq_address],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    ]
    for run, actor in zip(runs, ("gateway", "zmq_endpoint")):
        output, _ = run.communicate(timeout=120)
        assert run.returncode != 0
        assert "Address already in use" in output and f"{actor} failed during start" in output
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # the first one is fine


def test_in_process_engine_without_api_key():
    """The gateway and endpoint embedded in a `ServingEngine`; no key configured, no auth.
    A second gateway watches an actor that does not exist: its /health says so (503)."""
    port = pick_free_tcp_port()
    zmq_port = pick_free_tcp_port(exclude={port})
    watcher_port = pick_free_tcp_port(exclude={port, zmq_port})
    zmq_address = f"tcp://127.0.0.1:{zmq_port}"
    cfg = small_config(server__port=port)
    assert cfg.server.api_key == ""
    watcher = ActorSpec(
        "watcher",
        "actors.frontends.http.actor:GatewayActor",
        dict(port=watcher_port, watched_actors=["tokenizer", "ghost"]),
    )

    async def run() -> None:
        specs = [*serving_specs(cfg, zmq_address), watcher]
        async with ServingEngine(cfg, extra_specs=specs):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                health = await http.get(f"http://127.0.0.1:{watcher_port}/health")
                assert health.status_code == 503 and list(health.json()["down"]) == ["ghost"]
                assert (await http.get("/health")).status_code == 200
                assert (await http.get("/v1/models")).status_code == 200
                resp = await http.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
                )
                assert resp.status_code == 200, resp.text
            async with KvactorClient(zmq_address) as client:
                done = await client.complete(
                    prompt=PROMPT, params=GenerationParams(max_tokens=4, temperature=0.0)
                )
            assert done.text == resp.json()["choices"][0]["text"]
        # The engine is stopped: the port is free again.
        with socket.create_server(("127.0.0.1", port)):
            pass

    anyio.run(run)
