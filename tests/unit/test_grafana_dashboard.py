"""configs/grafana-dashboard.json reads only series /metrics exports, under their names."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from actors.frontends.http.metrics import GatewayMetrics
from transport.messages.alloc import KvStats
from transport.messages.engine import SchedulerStats

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana-dashboard.json"
METRIC = re.compile(r"\b((?:vllm|kvactor):[a-z0-9_]+|process_[a-z0-9_]+)")


def exported_series() -> set[str]:
    m = GatewayMetrics("m", 4096)
    m.count_finished("length", 10, 4, 2, 0.1)
    m.count_success(1.0)
    m.ttft.observe(0.1)
    m.itl.observe(0.01)
    kv = KvStats(
        page_size=16,
        total_pages=8,
        free_pages=8,
        tree_pages=0,
        held_pages=0,
        session_pages=0,
        evictable_pages=0,
        records=0,
        held_rows=0,
        cache_hit_tokens=0,
        evicted_pages=0,
        admitted=0,
        finished=0,
        aborted=0,
        retracted=0,
    )
    s = SchedulerStats(
        waiting=0,
        running=0,
        prefilling=0,
        steps=0,
        decode_steps=0,
        retractions=0,
        prompt_tokens=0,
        generated_tokens=0,
        cached_tokens=0,
        new_token_ratio=0.5,
    )
    text = m.render(s, kv).decode()
    return {sample.name for f in text_string_to_metric_families(text) for sample in f.samples}


def test_every_dashboard_query_names_an_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series()
    used = {
        name
        for p in dashboard["panels"]
        for t in p["targets"]
        for name in METRIC.findall(t["expr"])
    }
    assert used, "the dashboard queries nothing"
    assert not used - exported, f"not exported: {sorted(used - exported)}"
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc"} <= used
