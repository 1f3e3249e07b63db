"""Prometheus metrics of the gateway, through `prometheus_client`, named as dashboards expect.

The series vLLM exports keep vLLM's names, types and labels (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ..., each with `model_name`), so a vLLM Grafana
dashboard reads them unchanged (`configs/grafana-dashboard.json` is ours). kvactor's own
series (requests by HTTP outcome, KV pages by owner, records, rows, retractions, evictions,
the idle check, the memory plan's figures at start) are under `kvactor:`. One registry per
gateway also carries the process collector (CPU, RSS, open fds). Engine figures come from
the scheduler's and the allocator's stats, fetched by the `/metrics` handler right before
each scrape (`EngineCollector`); the tokens-per-step histogram (`vllm:iteration_tokens_total`)
is the scheduler's, its stats carry the bucket counts. Per-request series are observed here
as each choice finishes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from transport.messages.alloc import KvStats
from transport.messages.engine import SchedulerStats

VLLM = "vllm:"
OWN = "kvactor:"
CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()

# vLLM's bucket bounds (seconds), so dashboards' quantiles line up.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# vLLM's buckets of `vllm:request_params_n`.
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)

OUTCOME_SUCCESS = "success"  # finished normally (stop or length)
OUTCOME_ERROR = "error"  # refused (4xx) or failed (5xx)
OUTCOME_ABORTED = "aborted"  # the client left before the end
# The `endpoint` label of generation requests, exported from the start (0 until used);
# other routes get theirs when first counted.
GENERATION_ENDPOINTS = ("completions", "chat_completions", "responses", "messages")


# The memory plan's figures at start (kernels/memory_plan.py), as gauges: each is taken from
# the gateway's `cache_config` under its name (bytes, as a string) rather than as a label.
MEMORY_GAUGES = {
    "memory_weights_bytes": "Estimated bytes of the model's weights as loaded (at start)",
    "memory_kv_pool_bytes": "Bytes of the KV pool, every pool as allocated (at start)",
    "memory_available_bytes": "Memory available on the model's device at start",
}


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's request-length buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class EngineCollector(Collector):
    """Engine gauges and counters read at scrape time from the last fetched stats."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.scheduler: SchedulerStats | None = None
        self.kv: KvStats | None = None

    def update(self, scheduler: SchedulerStats | None, kv: KvStats | None) -> None:
        self.scheduler, self.kv = scheduler, kv

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        up = GaugeMetricFamily(
            f"{OWN}engine_stats_up",
            "1 when the engine answered the stats query",
            labels=["model_name", "source"],
        )
        up.add_metric([m, "scheduler"], int(self.scheduler is not None))
        up.add_metric([m, "allocator"], int(self.kv is not None))
        yield up
        s = self.scheduler
        if s is not None:
            yield _gauge(
                f"{VLLM}num_requests_running",
                "Requests in model execution batches",
                m,
                s.running + s.prefilling,
            )
            yield _gauge(
                f"{VLLM}num_requests_waiting", "Requests waiting to be admitted", m, s.waiting
            )
            yield _gauge(
                f"{OWN}num_requests_prefilling",
                "Running requests still in chunked prefill",
                m,
                s.prefilling,
            )
            yield _counter(f"{OWN}scheduler_steps", "Engine steps", m, s.steps)
            yield _counter(
                f"{OWN}runner_busy_seconds",
                "Seconds the runner spent in its steps (forward and sampling): against the "
                "wall clock, the share of time the model computes",
                m,
                s.runner_busy_s,
            )
            yield _counter(
                f"{VLLM}num_preemptions",
                "Cumulative number of preemption from the engine.",
                m,
                s.retractions,
            )
            if s.step_tokens_bounds:
                steps = HistogramMetricFamily(
                    f"{VLLM}iteration_tokens_total",
                    "Histogram of number of tokens per engine_step.",
                    labels=["model_name"],
                )
                steps.add_metric(
                    [m],
                    [
                        *((_le(b), n) for b, n in zip(s.step_tokens_bounds, s.step_tokens_buckets)),
                        ("+Inf", s.step_tokens_count),
                    ],
                    sum_value=s.step_tokens_sum,
                )
                yield steps
            yield from _speculation(s, m)
            yield _counter(
                f"{OWN}scheduler_retractions",
                "Requests retracted under KV pressure",
                m,
                s.retractions,
            )
            yield _counter(
                f"{OWN}scheduler_prompt_tokens",
                "Prompt tokens computed by the engine (cache hits excluded)",
                m,
                s.prompt_tokens,
            )
            yield _counter(
                f"{OWN}scheduler_generated_tokens",
                "Tokens generated by the engine",
                m,
                s.generated_tokens,
            )
        kv = self.kv
        if kv is not None:
            in_use = kv.held_pages + kv.tree_pages - kv.evictable_pages
            yield _gauge(
                f"{VLLM}kv_cache_usage_perc",
                "KV cache usage: 1 means 100 percent (pages requests hold or lock)",
                m,
                in_use / max(kv.total_pages, 1),
            )
            pages = GaugeMetricFamily(
                f"{OWN}kv_pages",
                f"KV cache pages by owner ({kv.page_size} tokens a page)",
                labels=["model_name", "state"],
            )
            for state, value in (
                ("total", kv.total_pages),
                ("free", kv.free_pages),
                ("tree", kv.tree_pages),
                ("held", kv.held_pages),
                ("session", kv.session_pages),
                ("evictable", kv.evictable_pages),
            ):
                pages.add_metric([m, state], value)
            yield pages
            yield _gauge(f"{OWN}kv_request_records", "Live request KV records", m, kv.records)
            if kv.swa_total_pages:
                swa = GaugeMetricFamily(
                    f"{OWN}kv_swa_pages",
                    "Sliding-window layers' KV pages (their own pool)",
                    labels=["model_name", "state"],
                )
                swa.add_metric([m, "total"], kv.swa_total_pages)
                swa.add_metric([m, "free"], kv.swa_free_pages)
                yield swa
                yield _counter(
                    f"{OWN}kv_swa_freed_pages",
                    "Sliding-layer pages freed because the window had passed them",
                    m,
                    kv.swa_freed_pages,
                )
                yield _counter(
                    f"{OWN}kv_tree_heals",
                    "Prefix-tree pages whose freed sliding KV was replaced by a fresh page",
                    m,
                    kv.tree_heals,
                )
            yield _gauge(f"{OWN}sessions_open", "Open streaming sessions", m, kv.sessions_open)
            yield _gauge(
                f"{OWN}sessions_holding_kv",
                "Streaming sessions whose slot holds KV between turns",
                m,
                kv.session_slots,
            )
            yield _counter(
                f"{OWN}session_hit_tokens",
                "Prompt tokens served from streaming sessions' KV",
                m,
                kv.session_hit_tokens,
            )
            yield _counter(
                f"{OWN}session_reclaims",
                "Idle sessions whose KV went to the prefix tree (pin cap or KV pressure)",
                m,
                kv.session_reclaims,
            )
            if kv.host_tier_budget:
                yield _used_and_budget(
                    f"{OWN}kv_host_tier_bytes",
                    "Host tier below the pool: bytes held by idle sessions' KV, and its budget",
                    m,
                    kv.host_tier_bytes,
                    kv.host_tier_budget,
                )
                if kv.disk_tier_budget:
                    yield _used_and_budget(
                        f"{OWN}kv_disk_tier_bytes",
                        "Disk tier below the host tier: bytes of its files, and its budget",
                        m,
                        kv.disk_tier_bytes,
                        kv.disk_tier_budget,
                    )
                    yield _gauge(
                        f"{OWN}sessions_in_disk_tier",
                        "Streaming sessions whose KV waits in the disk tier",
                        m,
                        kv.disk_tier_entries,
                    )
                    yield _gauge(
                        f"{OWN}disk_tier_files_writing",
                        "Disk-tier entries whose file is being written (still in memory)",
                        m,
                        kv.disk_tier_writing,
                    )
                yield _gauge(
                    f"{OWN}prefix_blocks_in_tiers",
                    "Evicted prefix-tree blocks the host and disk tiers keep",
                    m,
                    kv.prefix_blocks,
                )
                yield _gauge(
                    f"{OWN}sessions_in_host_tier",
                    "Streaming sessions whose KV waits in the host tier",
                    m,
                    kv.host_tier_entries,
                )
                for name, doc, value in (
                    (
                        "session_demotes",
                        "Idle sessions' KV copied to the host tier",
                        kv.session_demotes,
                    ),
                    (
                        "session_promotes",
                        "Session turns that loaded their history from it",
                        kv.session_promotes,
                    ),
                    (
                        "host_tier_loaded_tokens",
                        "Positions loaded from it, not prefilled",
                        kv.promoted_tokens,
                    ),
                    ("host_tier_drops", "Entries it dropped to fit its budget", kv.tier_drops),
                    (
                        "host_tier_failures",
                        "Copies the runner failed (prefilled instead)",
                        kv.tier_failures,
                    ),
                    ("host_tier_spills", "Entries moved to the disk tier", kv.tier_spills),
                    (
                        "disk_tier_promotes",
                        "Session turns that loaded their history from the disk tier",
                        kv.disk_promotes,
                    ),
                    (
                        "disk_tier_reads_ahead",
                        "Returning sessions' disk files read and verified beside the steps",
                        kv.disk_reads_ahead,
                    ),
                    (
                        "prefix_block_demotes",
                        "Evicted prefix-tree blocks copied to the host tier",
                        kv.block_demotes,
                    ),
                    (
                        "prefix_block_promotes",
                        "Admissions that loaded prefix blocks from a tier",
                        kv.block_promotes,
                    ),
                    (
                        "prefix_block_loaded_tokens",
                        "Positions loaded from prefix blocks, not prefilled",
                        kv.block_loaded_tokens,
                    ),
                ):
                    yield _counter(f"{OWN}{name}", doc, m, value)
            yield _gauge(f"{OWN}kv_held_rows", "req-to-token rows held", m, kv.held_rows)
            yield _counter(
                f"{OWN}kv_cache_hit_tokens",
                "Prompt tokens served from the prefix cache",
                m,
                kv.cache_hit_tokens,
            )
            yield _counter(
                f"{OWN}kv_evicted_pages", "Prefix-tree pages evicted", m, kv.evicted_pages
            )
            yield _counter(f"{OWN}kv_retractions", "Request records retracted", m, kv.retracted)
            yield _counter(f"{OWN}kv_aborted", "Request records released by abort", m, kv.aborted)
            yield _counter(
                f"{OWN}kv_idle_checks",
                "KV conservation checks run when the engine went idle",
                m,
                kv.idle_checks,
            )
            yield _counter(
                f"{OWN}kv_idle_check_failures",
                "Idle KV checks that found pages, records, rows or locks still held",
                m,
                kv.idle_check_failures,
            )


def _speculation(s: SchedulerStats, m: str) -> Iterator[Metric]:
    """vLLM's speculative decoding counters (zero while speculation is off)."""
    yield _counter(
        f"{VLLM}spec_decode_num_drafts", "Number of spec decoding drafts.", m, s.spec_drafts
    )
    yield _counter(
        f"{VLLM}spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        m,
        s.spec_draft_tokens,
    )
    yield _counter(
        f"{VLLM}spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        m,
        s.spec_accepted_tokens,
    )
    per_position = CounterMetricFamily(
        f"{VLLM}spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=["model_name", "position"],
    )
    for position, accepted in enumerate(s.spec_accepted_per_position):
        per_position.add_metric([m, str(position)], accepted)
    yield per_position


def _le(bound: float) -> str:
    return floatToGoString(bound)  # as prometheus_client's Histogram writes bounds: "8.0"


def _used_and_budget(name: str, doc: str, model: str, used: int, budget: int):
    family = GaugeMetricFamily(name, doc, labels=["model_name", "kind"])
    family.add_metric([model, "used"], used)
    family.add_metric([model, "budget"], budget)
    return family


def _gauge(name: str, help_text: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def _counter(name: str, help_text: str, model_name: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


class GatewayMetrics:
    """The gateway's registry; the app counts into it, `/metrics` renders it."""

    def __init__(
        self,
        model_name: str = "",
        max_model_len: int = 4096,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        """`cache_config`: the KV cache's settings under vLLM's label names (`block_size`,
        `num_gpu_blocks`, `enable_prefix_caching`, `cache_dtype`), exported as the labels
        of `vllm:cache_config_info` (not exported without it); its `MEMORY_GAUGES` entries
        (byte counts) are exported as those `kvactor:` gauges instead."""
        cache_config = dict(cache_config or {})
        memory = {k: float(cache_config.pop(k)) for k in MEMORY_GAUGES if k in cache_config}
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def hist(name: str, text: str, buckets) -> Histogram:
            return Histogram(name, text, m, buckets=buckets, registry=r).labels(model_name)

        def count(name: str, text: str) -> Counter:
            return Counter(name, text, m, registry=r).labels(model_name)

        self._requests = Counter(
            f"{OWN}requests",
            "HTTP generation requests by endpoint and outcome",
            [*m, "endpoint", "outcome"],
            registry=r,
        )
        self._http_errors = Counter(
            f"{OWN}http_errors",
            "Refused or failed requests by endpoint and HTTP status",
            [*m, "endpoint", "status"],
            registry=r,
        )
        self._success = Counter(
            f"{VLLM}request_success",
            "Finished requests by finish reason",
            [*m, "finished_reason"],
            registry=r,
        )
        self._prompt_tokens = count(f"{VLLM}prompt_tokens", "Prompt tokens of finished requests")
        self._generation_tokens = count(
            f"{VLLM}generation_tokens", "Generated tokens of finished requests"
        )
        self._cache_queries = count(
            f"{VLLM}prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self._cache_hits = count(
            f"{VLLM}prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.ttft = hist(f"{VLLM}time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist(
            f"{VLLM}inter_token_latency_seconds", "Time between output chunks", ITL_BUCKETS
        )
        self.e2e = hist(
            f"{VLLM}e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS
        )
        self.queue = hist(
            f"{VLLM}request_queue_time_seconds", "Time waiting for admission", LATENCY_BUCKETS
        )
        self._inference_time = hist(
            f"{VLLM}request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self._prefill_time = hist(
            f"{VLLM}request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self._decode_time = hist(
            f"{VLLM}request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        buckets = token_buckets(max_model_len)
        self._prompt_len = hist(
            f"{VLLM}request_prompt_tokens", "Prompt tokens per request", buckets
        )
        self._generation_len = hist(
            f"{VLLM}request_generation_tokens", "Generated tokens per request", buckets
        )
        self._params_n = hist(
            f"{VLLM}request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self._params_max_tokens = hist(
            f"{VLLM}request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            buckets,
        )
        if cache_config:
            info = Gauge(
                f"{VLLM}cache_config_info",
                "Information of the LLMEngine CacheConfig",
                [*m, *cache_config],
                registry=r,
            )
            info.labels(model_name, *cache_config.values()).set(1)
        for name, value in memory.items():
            Gauge(f"{OWN}{name}", MEMORY_GAUGES[name], m, registry=r).labels(model_name).set(value)
        self.engine = EngineCollector(model_name)
        r.register(self.engine)
        ProcessCollector(registry=r)
        # Every outcome is exported from the start (0 until it happens).
        self.requests: dict[str, int] = {}
        for outcome in (OUTCOME_SUCCESS, OUTCOME_ERROR, OUTCOME_ABORTED):
            for endpoint in GENERATION_ENDPOINTS:
                self._requests.labels(model_name, endpoint, outcome)
            self.requests[outcome] = 0
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def _count_request(self, outcome: str, endpoint: str) -> None:
        self._requests.labels(self.model_name, endpoint, outcome).inc()
        self.requests[outcome] += 1

    def count_error(self, status: int, endpoint: str = "") -> None:
        self._count_request(OUTCOME_ERROR, endpoint)
        self._http_errors.labels(self.model_name, endpoint, str(status)).inc()

    def count_aborted(self, endpoint: str = "") -> None:
        self._count_request(OUTCOME_ABORTED, endpoint)

    def count_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        queue_time_s: float = -1.0,
        *,
        max_tokens: int = 0,
        prefill_s: float = -1.0,
        decode_s: float = -1.0,
    ) -> None:
        """One engine request (one choice) that ran to its end. `max_tokens`: its params'
        (0: unknown), capped here at the room its prompt leaves in the context, as the
        tokenizer caps it; `prefill_s` (admission to first token) and `decode_s` (first
        token to last): negative when it produced no token."""
        self._success.labels(self.model_name, str(finish_reason)).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        self._cache_queries.inc(prompt_tokens)
        self._cache_hits.inc(cached_tokens)
        self._prompt_len.observe(prompt_tokens)
        self._generation_len.observe(completion_tokens)
        if queue_time_s >= 0:
            self.queue.observe(queue_time_s)
        if max_tokens > 0:
            room = self.max_model_len - prompt_tokens
            self._params_max_tokens.observe(min(max_tokens, room) if room > 0 else max_tokens)
        if prefill_s >= 0 and decode_s >= 0:
            self._prefill_time.observe(prefill_s)
            self._decode_time.observe(decode_s)
            self._inference_time.observe(prefill_s + decode_s)

    def count_params_n(self, n: int) -> None:
        """One prompt whose `n` choices all finished (vLLM observes n once per parent)."""
        self._params_n.observe(n)

    def count_success(self, latency_s: float, endpoint: str = "") -> None:
        """One HTTP request whose every choice finished."""
        self._count_request(OUTCOME_SUCCESS, endpoint)
        self.e2e.observe(latency_s)

    def render(self, scheduler: SchedulerStats | None, kv: KvStats | None) -> bytes:
        self.engine.update(scheduler, kv)
        return generate_latest(self.registry)
