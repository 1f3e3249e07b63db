"""The benchmark tools on tiny workloads against the shared server: they run, and their
JSON holds what they promise. (They report numbers; nothing here judges them.)"""

from __future__ import annotations

import json

import pytest

from actors.bench import serve
from tests.e2e.server_fixtures import MODEL_NAME

pytestmark = [pytest.mark.model]


def bench(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    code = serve.main(
        [
            "--base-url",
            server.base_url,
            "--api-key",
            server.api_key,
            "--model",
            MODEL_NAME,
            "--output-json",
            str(out),
            "--plot-dir",
            str(tmp_path / "plots"),
            *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_random_dataset_with_fixed_lengths(server, tmp_path):
    doc = bench(
        server,
        tmp_path,
        "--num-prompts",
        "4",
        "--input-len",
        "24",
        "--output-len",
        "4",
        "--max-concurrency",
        "2",
        "--ignore-eos",
    )
    [run] = doc["runs"]
    assert run["completed"] == 4 and run["failed"] == 0
    assert run["output_tokens"] == 16 and run["input_tokens"] >= 4 * 20
    assert run["max_concurrency"] == 2
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(run[key]) == {"mean", "p50", "p90", "p99"}
        assert run[key]["p99"] >= run[key]["p50"] >= 0
    assert 0 < run["ttft_s"]["mean"] <= run["e2e_s"]["mean"]
    # ITL is between content chunks: at most 3 gaps per 4-token request (a token whose text
    # the detokenizer holds back rides in the next chunk).
    assert 4 <= len(run["samples"]["itl_s"]) <= 4 * 3
    # TPOT is per token: each request's time after its first token over its 3 others
    assert len(run["samples"]["tpot_s"]) == 4 and run["tpot_s"]["p50"] > 0
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_shared_prefix_hits_the_cache_and_a_sweep_plots(server, tmp_path):
    doc = bench(
        server,
        tmp_path,
        "--dataset",
        "shared-prefix",
        "--num-prompts",
        "3",
        "--system-prompt-len",
        "96",
        "--question-len",
        "8",
        "--output-len",
        "2",
        "--concurrency-sweep",
        "1,3",
    )
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 3]
    assert all(r["completed"] == 3 for r in doc["runs"])
    assert doc["runs"][1]["cached_tokens"] >= 3 * 64  # the system prompt came from the cache
    assert (tmp_path / "plots" / "vs_concurrency.png").exists()


def test_multi_turn_sends_the_whole_conversation(server, tmp_path):
    doc = bench(
        server,
        tmp_path,
        "--dataset",
        "multi-turn",
        "--num-prompts",
        "2",
        "--turns",
        "2",
        "--question-len",
        "8",
        "--output-len",
        "3",
        "--max-concurrency",
        "2",
    )
    [run] = doc["runs"]
    assert run["completed"] == 4
    assert run["cached_tokens"] > 0  # the second turn re-sends the first: a prefix hit


def test_copy_dataset_runs_against_the_server(server, tmp_path):
    doc = bench(
        server,
        tmp_path,
        "--dataset",
        "copy",
        "--num-prompts",
        "2",
        "--input-len",
        "64",
        "--output-len",
        "8",
        "--max-concurrency",
        "2",
    )
    assert doc["dataset"] == "copy"
    [run] = doc["runs"]
    assert run["completed"] == 2 and run["failed"] == 0
    assert run["input_tokens"] >= 2 * 48  # the document, the ask and the start of the copy
    assert 0 < run["output_tokens"] <= 16


def test_soak_samples_every_engine_process_and_finds_no_leak(tmp_path):
    """A 20-second soak with the runner in its own process: both processes are sampled,
    requests complete (some closed early), the KV is whole afterwards, exit 0."""
    from actors.bench import soak

    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--minutes",
            "0.33",
            "--warmup-minutes",
            "0.08",
            "--sample-s",
            "1",
            "--concurrency",
            "4",
            "--max-tokens",
            "8",
            "--multi-process",
            "--log",
            str(tmp_path / "server.log"),
            "--output-json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert code == 0, result
    assert result["requests_ok"] > 0 and result["requests_failed"] == 0
    assert result["kv_after"]["held_pages"] == 0 and result["kv_after"]["request_records"] == 0
    kinds = {row["process"] for row in result["processes"]}
    assert {"server", "child"} <= kinds, result["processes"]
    assert all(row["samples"] >= 5 and row["rss_end_mb"] > 0 for row in result["processes"])


def test_sessions_bench_reuses_history_and_answers_as_without_a_session(server, tmp_path):
    """Three sessions of two turns and the restore probe against the shared server: every
    turn answers, later turns find their history cached, the verified answers equal the
    same prompts sent without a session, and the probe restores from the host tier."""
    from actors.bench import sessions

    out = tmp_path / "sessions.json"
    code = sessions.main(
        [
            "--url",
            server.base_url,
            "--api-key",
            server.api_key,
            "--sessions",
            "3",
            "--turns",
            "2",
            "--concurrency",
            "2",
            "--all-open",
            "--new-tokens",
            "40",
            "--output-tokens",
            "4",
            "--pause-s",
            "0.05",
            "--verify",
            "2",
            "--restore-tokens",
            "150",  # one prefill chunk: the tree keeps nothing of it, no flush needed
            "--no-flush",
            "--output-json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert code == 0, result
    assert result["turns_ok"] == 6 and result["turns_failed"] == 0
    # each first turn (~40 new tokens, 4 output) is history to its second
    assert result["history_tokens"] > 3 * 30 and result["reprefilled_share"] < 0.1, result
    assert result["verify"] == {"same": 4, "differ": 0}  # every turn of two sessions
    probe = result["restore"]
    assert probe["host_tier_cached_tokens"] >= probe["history_tokens"] - 1, probe
    assert probe["host_tier_loaded_tokens"] >= probe["history_tokens"] - 1, probe  # the tier's
    assert probe["pool_cached_tokens"] >= probe["history_tokens"] - 1, probe
    assert probe["prefill_ttft_s"] > 0 and result["host_tier"]["promotes"] >= 1
    assert set(result["ttft_by_turn"]) == {"0", "1"}


def test_sessions_bench_restarts_the_server_and_finds_the_history_in_the_store(tmp_path):
    """`--restart-after-turn 1`: the server drains (its sessions go to the store) and starts
    again on the same store; every session's next turn finds its whole history cached, and
    the answers equal the same prompts sent without a session."""
    from actors.bench import sessions

    out = tmp_path / "sessions.json"
    sets = ["model.dtype=float32", "model.linear=aten", "model.threads=1", "kv.num_pages=128"]
    code = sessions.main(
        [
            *("--sessions", "2", "--turns", "2", "--concurrency", "2", "--all-open"),
            *("--new-tokens", "40", "--output-tokens", "4", "--pause-s", "0.05"),
            *("--verify", "2", "--restore-tokens", "0", "--restart-after-turn", "1"),
            *[arg for pair in sets for arg in ("--set", pair)],
            *("--set", f"kv.store_dir={tmp_path / 'store'}"),
            *("--log", str(tmp_path / "server.log"), "--output-json", str(out)),
        ]
    )
    result = json.loads(out.read_text())
    assert code == 0, result
    assert result["turns_ok"] == 4 and result["verify"] == {"same": 4, "differ": 0}
    restarted = result["after_restart"]
    assert restarted["turns"] == 2 and restarted["history_tokens"] > 2 * 30, restarted
    assert restarted["cached_share"] >= 0.9 and restarted["sessions_below_90pct"] == 0
    # the history came back from the store's files (the pool died with the first server)
    assert result["host_tier"]["disk_promotes"] == 2, result["host_tier"]
    assert (tmp_path / "server.log").read_text().count("actor system ready") == 2


def test_sessions_bench_refuses_a_restart_it_cannot_measure():
    from actors.bench import sessions

    with pytest.raises(SystemExit):  # no store: nothing would survive the restart
        sessions.parse_args(["--all-open", "--turns", "2", "--restart-after-turn", "1"])
    with pytest.raises(SystemExit):  # K must leave a turn after the restart
        sessions.parse_args(
            ["--all-open", "--turns", "2", "--restart-after-turn", "2", "--set", "kv.store_dir=x"]
        )
