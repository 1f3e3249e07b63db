"""Prometheus metrics of the gateway, rendered in the text exposition format (version 0.0.4).

`GatewayMetrics` owns the gateway's own counters and latency histograms (requests by
outcome, tokens, TTFT, inter-token latency, end-to-end latency). `render` adds engine
gauges fetched at scrape time: the scheduler's queues and the allocator's KV pages.
No client library: the format is a few lines of text.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

from transport.messages.alloc import KvStats
from transport.messages.engine import SchedulerStats

PREFIX = "kvactor_"
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds in seconds (the +Inf bucket is implicit).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

OUTCOME_SUCCESS = "success"  # finished normally (stop or length)
OUTCOME_ERROR = "error"  # refused (4xx) or failed (5xx)
OUTCOME_ABORTED = "aborted"  # the client left before the end


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_number(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


class GatewayMetrics:
    """Counters and histograms updated by the app; read by `render`."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {
            OUTCOME_SUCCESS: 0,
            OUTCOME_ERROR: 0,
            OUTCOME_ABORTED: 0,
        }
        self.finish_reasons: dict[str, int] = defaultdict(int)
        self.http_errors: dict[int, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def count_error(self, status: int) -> None:
        self.requests[OUTCOME_ERROR] += 1
        self.http_errors[status] += 1

    def count_aborted(self) -> None:
        self.requests[OUTCOME_ABORTED] += 1

    def count_finished(
        self, finish_reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> None:
        """One engine request (one choice) that ran to its end."""
        self.finish_reasons[finish_reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        self.cached_tokens += cached_tokens

    def count_success(self, latency_s: float) -> None:
        """One HTTP request whose every choice finished."""
        self.requests[OUTCOME_SUCCESS] += 1
        self.e2e.observe(latency_s)

    def render(self, scheduler: SchedulerStats | None, kv: KvStats | None) -> bytes:
        p = PREFIX
        lines: list[str] = []
        lines += _family(
            f"{p}requests_total",
            "counter",
            "HTTP generation requests by outcome",
            [(f'outcome="{k}"', v) for k, v in self.requests.items()],
        )
        lines += _family(
            f"{p}request_finish_total",
            "counter",
            "Finished choices by finish reason",
            [(f'reason="{k}"', v) for k, v in sorted(self.finish_reasons.items())],
        )
        lines += _family(
            f"{p}http_errors_total",
            "counter",
            "Refused or failed requests by HTTP status",
            [(f'status="{k}"', v) for k, v in sorted(self.http_errors.items())],
        )
        lines += _family(
            f"{p}prompt_tokens_total", "counter", "Prompt tokens of finished choices",
            [("", self.prompt_tokens)],
        )
        lines += _family(
            f"{p}generation_tokens_total", "counter", "Generated tokens of finished choices",
            [("", self.generation_tokens)],
        )
        lines += _family(
            f"{p}cached_prompt_tokens_total", "counter",
            "Prompt tokens of finished choices served from the prefix cache",
            [("", self.cached_tokens)],
        )
        lines += self.ttft.lines(f"{p}time_to_first_token_seconds", "Time to first token")
        lines += self.itl.lines(f"{p}inter_token_latency_seconds", "Time between output chunks")
        lines += self.e2e.lines(f"{p}e2e_request_latency_seconds", "End-to-end request latency")
        lines += _family(
            f"{p}engine_stats_up", "gauge", "1 when the engine answered the stats query",
            [('source="scheduler"', int(scheduler is not None)),
             ('source="allocator"', int(kv is not None))],
        )
        if scheduler is not None:
            s = scheduler
            lines += _family(f"{p}num_requests_running", "gauge", "Requests in the "
                             "running (decode) set", [("", s.running)])
            lines += _family(f"{p}num_requests_waiting", "gauge", "Requests queued for "
                             "admission", [("", s.waiting)])
            lines += _family(f"{p}num_requests_prefilling", "gauge", "Requests in chunked "
                             "prefill", [("", s.prefilling)])
            lines += _family(f"{p}scheduler_steps_total", "counter", "Engine steps",
                             [("", s.steps)])
            lines += _family(f"{p}scheduler_retractions_total", "counter",
                             "Requests retracted under KV pressure", [("", s.retractions)])
            lines += _family(f"{p}scheduler_prompt_tokens_total", "counter",
                             "Prompt tokens computed by the engine", [("", s.prompt_tokens)])
            lines += _family(f"{p}scheduler_generated_tokens_total", "counter",
                             "Tokens generated by the engine", [("", s.generated_tokens)])
        if kv is not None:
            lines += _family(
                f"{p}kv_pages",
                "gauge",
                f"KV cache pages by owner ({kv.page_size} tokens a page)",
                [
                    ('state="total"', kv.total_pages),
                    ('state="free"', kv.free_pages),
                    ('state="tree"', kv.tree_pages),
                    ('state="held"', kv.held_pages),
                    ('state="session"', kv.session_pages),
                    ('state="evictable"', kv.evictable_pages),
                ],
            )
            lines += _family(f"{p}kv_request_records", "gauge", "Live request KV records",
                             [("", kv.records)])
            lines += _family(f"{p}kv_held_rows", "gauge", "req-to-token rows held",
                             [("", kv.held_rows)])
            lines += _family(f"{p}kv_cache_hit_tokens_total", "counter",
                             "Prompt tokens served from the prefix cache",
                             [("", kv.cache_hit_tokens)])
            lines += _family(f"{p}kv_evicted_pages_total", "counter",
                             "Prefix-tree pages evicted", [("", kv.evicted_pages)])
            lines += _family(f"{p}kv_retractions_total", "counter",
                             "Request records retracted", [("", kv.retracted)])
            lines += _family(f"{p}kv_aborted_total", "counter",
                             "Request records released by abort", [("", kv.aborted)])
        return ("\n".join(lines) + "\n").encode()


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        out.append(f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return out


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))
