"""The vLLM series of issue 29 (compat item 10) as far as no server is needed: tokens per
engine step (`vllm:iteration_tokens_total`): the scheduler's histogram, what its stats carry
and how the gateway renders them; preemptions; the per-request histograms; cache config."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.frontends.http.metrics import GatewayMetrics
from actors.scheduler.batch import PrefillWork
from actors.scheduler.core import SchedulerCore
from actors.scheduler.policy import NewTokenRatio, Policy, SchedulerLimits
from actors.scheduler.request import Req
from actors.scheduler.stats import STEP_TOKEN_BOUNDS, StepTokenHistogram
from transport.messages.engine import SchedulerStats
from transport.messages.params import GenerationParams


def test_vllm_bounds():
    assert STEP_TOKEN_BOUNDS == (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def test_a_step_falls_in_the_first_bucket_whose_bound_holds_it():
    h = StepTokenHistogram((1, 8, 16))
    for tokens in (1, 2, 8, 9, 16, 17, 100):
        h.observe(tokens)
    # le=1: {1}; le=8: {1, 2, 8}; le=16: {1, 2, 8, 9, 16}; +Inf: all 7
    assert h.cumulative() == [1, 3, 5]
    assert h.count == 7 and h.sum == 1 + 2 + 8 + 9 + 16 + 17 + 100
    assert h.counts == [1, 2, 2, 2]  # per bucket, the last above every bound


def test_an_empty_histogram_and_bad_bounds():
    h = StepTokenHistogram()
    assert h.cumulative() == [0] * len(STEP_TOKEN_BOUNDS) and h.sum == h.count == 0
    with pytest.raises(ValueError):
        StepTokenHistogram((8, 1))
    with pytest.raises(ValueError):
        StepTokenHistogram((1, 1))


def _req(rid: int, prompt: int) -> Req:
    return Req(
        rid=rid,
        prompt_ids=list(range(10, 10 + prompt)),
        params=GenerationParams(max_tokens=8),
        eos_ids=frozenset({2}),
        stop_ids=frozenset(),
    )


def test_the_core_counts_decode_and_prefill_tokens_of_each_built_step():
    limits = SchedulerLimits(
        page_size=4, row_capacity=256, max_running=8, max_batch_tokens=64, chunk_size=16
    )
    core = SchedulerCore(limits, policy_name=Policy.FCFS, ratio=NewTokenRatio(0.5, 0.1))
    a, b, c = _req(1, 20), _req(2, 40), _req(3, 4)
    core.build_batch([], [PrefillWork(a, 0, 16)])  # 16 prompt tokens
    core.build_batch([a], [PrefillWork(b, 0, 16), PrefillWork(c, 0, 4)])  # 1 + 16 + 4
    core.build_batch([a, c], [])  # 2 decode tokens
    s = core.stats()
    assert s.steps == s.step_tokens_count == 3
    assert s.step_tokens_sum == 16 + 21 + 2
    assert s.step_tokens_bounds == list(STEP_TOKEN_BOUNDS)
    # le=1: 0; le=8: {2}; le=16: {2, 16}; le=32 on: all three
    assert s.step_tokens_buckets[:4] == [0, 1, 2, 3]
    assert s.step_tokens_buckets[-1] == 3


def _stats(**kw) -> SchedulerStats:
    base = dict(
        waiting=0,
        running=0,
        prefilling=0,
        steps=3,
        decode_steps=1,
        retractions=2,
        prompt_tokens=0,
        generated_tokens=0,
        cached_tokens=0,
        new_token_ratio=0.5,
    )
    return SchedulerStats(**{**base, **kw})


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_the_gateway_renders_the_step_histogram_and_preemptions():
    m = GatewayMetrics("m", 4096)
    stats = _stats(
        step_tokens_bounds=[1, 8, 16],
        step_tokens_buckets=[0, 1, 2],
        step_tokens_sum=39,
        step_tokens_count=3,
    )
    text = m.render(stats, None).decode()
    assert "# TYPE vllm:iteration_tokens_total histogram" in text
    got = _samples(text)
    h = "vllm:iteration_tokens_total"
    assert got[f'{h}_bucket{{le="1.0",model_name="m"}}'] == 0
    assert got[f'{h}_bucket{{le="8.0",model_name="m"}}'] == 1
    assert got[f'{h}_bucket{{le="16.0",model_name="m"}}'] == 2
    assert got[f'{h}_bucket{{le="+Inf",model_name="m"}}'] == 3
    assert got[f'{h}_count{{model_name="m"}}'] == 3
    assert got[f'{h}_sum{{model_name="m"}}'] == 39
    assert "# TYPE vllm:num_preemptions_total counter" in text
    assert got['vllm:num_preemptions_total{model_name="m"}'] == 2  # the retractions


def test_finished_requests_feed_the_params_and_phase_histograms():
    m = GatewayMetrics("m", 100)
    m.count_finished("length", 10, 5, 0, 0.5, max_tokens=5, prefill_s=0.25, decode_s=1.0)
    m.count_finished("length", 10, 5, 0, 0.5, max_tokens=5, prefill_s=0.25, decode_s=1.0)
    m.count_params_n(2)  # the two choices of one prompt
    # a default max_tokens beyond the context: the engine ran it with the room left (90)
    m.count_finished("stop", 10, 3, 0, max_tokens=4096, prefill_s=0.5, decode_s=0.0)
    m.count_params_n(1)
    m.count_finished("abort", 10, 0, 0)  # no token: no phase times, max_tokens unknown
    got = _samples(m.render(None, None).decode())

    def series(name: str, part: str) -> float:
        return got[f'vllm:{name}_{part}{{model_name="m"}}']

    assert series("request_params_n", "count") == 2 and series("request_params_n", "sum") == 3
    assert got['vllm:request_params_n_bucket{le="1.0",model_name="m"}'] == 1
    assert got['vllm:request_params_n_bucket{le="20.0",model_name="m"}'] == 2
    assert series("request_params_max_tokens", "count") == 3
    assert series("request_params_max_tokens", "sum") == 5 + 5 + 90
    assert got['vllm:request_params_max_tokens_bucket{le="100.0",model_name="m"}'] == 3
    assert series("request_prefill_time_seconds", "count") == 3
    assert series("request_prefill_time_seconds", "sum") == pytest.approx(1.0)
    assert series("request_decode_time_seconds", "sum") == pytest.approx(2.0)
    assert series("request_inference_time_seconds", "count") == 3
    assert series("request_inference_time_seconds", "sum") == pytest.approx(3.0)
    # vLLM's latency buckets
    assert got['vllm:request_inference_time_seconds_bucket{le="0.3",model_name="m"}'] == 0
    assert got['vllm:request_inference_time_seconds_bucket{le="1.5",model_name="m"}'] == 3


def test_cache_config_info_is_a_gauge_of_one_labelled_with_the_config():
    config = {
        "block_size": "16",
        "num_gpu_blocks": "512",
        "enable_prefix_caching": "True",
        "cache_dtype": "auto",
    }
    text = GatewayMetrics("m", 4096, config).render(None, None).decode()
    assert "# TYPE vllm:cache_config_info gauge" in text
    [(name, value)] = [(k, v) for k, v in _samples(text).items() if "cache_config_info" in k]
    assert value == 1
    labels = ",".join(f'{k}="{v}"' for k, v in sorted({**config, "model_name": "m"}.items()))
    assert name == f"vllm:cache_config_info{{{labels}}}"
    assert "cache_config_info" not in GatewayMetrics("m", 4096).render(None, None).decode()
