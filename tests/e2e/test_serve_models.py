"""`bin/engine serve MODEL` as a vLLM user runs it: a GGUF file or a Hugging Face folder,
answered under the model's own name, generation_config.json defaults, environment
overrides, and flags that fail at start naming what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.engine_fixtures import tiny_llama_folder
from tests.e2e.server_fixtures import ROOT, scrape_metrics, start_server, stop_server

pytestmark = [pytest.mark.model]


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory):
    folder = tiny_llama_folder(tmp_path_factory.mktemp("models"))
    handle = start_server(
        args=[str(folder), "--max-model-len", "256"],
        env={"KVACTOR_KV_NUM_PAGES": "48", "KVACTOR_LOG_LEVEL": "info"},
    )
    try:
        yield handle, folder
    finally:
        stop_server(handle)


def test_hf_folder_is_served_under_its_own_names(hf_server):
    server, folder = hf_server
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.auth).json()
    names = [m["id"] for m in models["data"]]
    assert names == [str(folder), "tiny-llama"]
    assert models["data"][0]["max_model_len"] == 256  # --max-model-len
    for name in names:
        body = {"model": name, "prompt": "w5 w6 w7", "ignore_eos": True}
        resp = httpx.post(
            f"{server.base_url}/v1/completions", json=body, headers=server.auth, timeout=60
        )
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["model"] == name
        # generation_config.json: 5 new tokens by default (not OpenAI's 16), greedy
        assert out["usage"]["completion_tokens"] == 5
    again = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.auth,
        timeout=60,
        json={"model": "tiny-llama", "prompt": "w5 w6 w7", "ignore_eos": True},
    )
    assert again.json()["choices"][0]["text"] == out["choices"][0]["text"]
    explicit = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.auth,
        timeout=60,
        json={"model": "tiny-llama", "prompt": "w5", "max_tokens": 2, "ignore_eos": True},
    )
    assert explicit.json()["usage"]["completion_tokens"] == 2  # the request wins


def test_environment_overrides_reach_the_config(hf_server):
    # start_server passes --set kv.num_pages=512; an environment variable ranks below --set
    server, folder = hf_server
    metrics = scrape_metrics(server, model_name=str(folder))  # the main served name
    assert metrics['kvactor:kv_pages{state="total"}'] == 512


def test_environment_override_applies_without_a_set():
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "from actors.app.config import load_config;print(load_config(None, []).kv.num_pages)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVACTOR_KV_NUM_PAGES": "48", "KVACTOR_LOG_LEVEL": "warning"},
    )
    assert res.stdout.strip() == "48", res.stderr


def test_gguf_file_is_served_under_its_path_and_stem():
    from kernels.gguf_loader import default_model_path

    path = default_model_path()
    server = start_server(
        args=[str(path), "--served-model-name", "gemma", "g3"], extra=["kv.num_pages=64"]
    )
    try:
        names = [
            m["id"]
            for m in httpx.get(f"{server.base_url}/v1/models", headers=server.auth).json()["data"]
        ]
        assert names == ["gemma", "g3"]
        resp = httpx.post(
            f"{server.base_url}/v1/completions",
            headers=server.auth,
            timeout=60,
            json={"model": "g3", "prompt": "1, 2, 3,", "max_tokens": 2},
        )
        assert resp.status_code == 200 and resp.json()["model"] == "g3"
    finally:
        stop_server(server)
    default = subprocess.run(
        [
            sys.executable,
            "-c",
            "from actors.app.config import load_config;"
            "from actors.app.cli import serve_overrides, main;"
            "from actors.app.model_info import served_names;"
            "import argparse, sys;"
            f"cfg = load_config(None, [], **{{'model.path': {str(path)!r}}});"
            "print(served_names(cfg))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert default.stdout.strip() == str([str(path), path.stem]), default.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--max-model-len", "abc"], "--max-model-len"),
        (["--dtype", "int4"], "model.dtype"),
        (["--max-num-seqs", "4", "--set", "kv.max_rows=2"], "kv.max_rows"),
        (["--set", "server.hots=1"], "unknown config key server.hots"),
    ],
)
def test_bad_flags_fail_at_start_naming_them(args, named):
    res = subprocess.run(
        [sys.executable, "-m", "actors.app.cli", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and named in res.stderr, res.stderr[-2000:]


def test_environment_variable_with_a_bad_value_names_its_key():
    res = subprocess.run(
        [sys.executable, "-m", "actors.app.cli", "serve"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVACTOR_KV_NUM_PAGES": "many"},
    )
    assert res.returncode != 0 and "kv.num_pages" in res.stderr, res.stderr[-2000:]
