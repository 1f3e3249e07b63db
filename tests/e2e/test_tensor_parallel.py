"""`parallel.tensor_parallel_size = 2` through every actor, on the real embedded model: the
runner is rank 0 of a gloo group and starts rank 1 as a process of its own; the scheduler and
the allocator are the one-rank ones (one record per request, whatever the rank count).
Greedy output equals HF transformers token for token (fp32), ragged concurrent prompts with
chunked prefill and prefix reuse included, and the pools balance afterwards. What a split
runner cannot run fails the start with a message naming it. Two "machines" on this one
(`--nnodes 2`, tcp on loopback): node 1 runs rank 1 and node 0 serves, as one engine; a
node holding another CURVE key, or pointed at an address where nobody listens, fails at
start naming which. (A rank killed under load: tests/e2e/test_reliability.py.)"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import httpx
import pytest

from actors.app.serving import ServingEngine
from actors.runtime import SystemStartError
from tests.e2e.engine_fixtures import natural_text, random_prompts, settle, small_config
from tests.e2e.server_fixtures import (
    MODEL_NAME,
    pick_free_tcp_port,
    session_gone,
    start_server,
    stop_server,
)
from tests.e2e.test_engine_e2e import hf_greedy
from transport.messages.engine import GenerationParams

pytestmark = [pytest.mark.anyio, pytest.mark.model]


@pytest.fixture(scope="module")
async def tp_engine(anyio_backend):
    async with ServingEngine(small_config(parallel__tensor_parallel_size=2)) as eng:
        yield eng


async def test_two_ranks_match_hf_greedy(tp_engine, tokenizer, hf_model):
    rng = random.Random(5)
    prompts = random_prompts(tokenizer, 6, 5, 700, seed=23)
    max_tokens = [rng.randint(4, 10) for _ in prompts]
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    results = await tp_engine.generate_batch(prompts, params)
    for ids, m, res in zip(prompts, max_tokens, results):
        assert res.token_ids == hf_greedy(hf_model, ids, m, tokenizer.eos_ids), len(ids)
    assert max(len(p) for p in prompts) > 256  # chunked (chunk_size 256)
    await settle(tp_engine)


async def test_two_ranks_reuse_a_cached_prefix(tp_engine, tokenizer, hf_model):
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    shared = [tokenizer.bos_id] + ids[200:520]
    first = shared + ids[900:910]
    second = shared + ids[1500:1512]
    greedy = GenerationParams(max_tokens=6, temperature=0.0)
    await tp_engine.generate_batch([first], [greedy])
    (res,) = await tp_engine.generate_batch([second], [greedy])
    assert res.cached_tokens >= 320 - 16  # whole pages of the shared prefix
    assert res.token_ids == hf_greedy(hf_model, second, 6, tokenizer.eos_ids)
    await settle(tp_engine)


async def test_a_quantized_split_is_refused_at_start(anyio_backend):
    cfg = small_config(parallel__tensor_parallel_size=2, model__quantization="int8")
    with pytest.raises(SystemStartError, match="tensor parallelism splits exact weights"):
        async with ServingEngine(cfg):
            pass


# ---- two "machines" on this one: node 0 serves, node 1 runs rank 1 ----------------------


def _node(node_rank: int, port: int, key: str, *more: str, host: str = "127.0.0.1") -> list[str]:
    return [
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--dist-init-addr",
        f"{host}:{port}",
        "--set",
        f"parallel.curve_secret_file={key}",
        *more,
    ]


def _start_node_1(port: int, key: str, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "actors.app.cli", "serve", *_node(1, port, key, *more)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.fixture
def keys(tmp_path):
    from transport.security import write_curve_keypair

    return write_curve_keypair(str(tmp_path / "a"))[1], write_curve_keypair(str(tmp_path / "b"))[1]


def test_two_nodes_serve_as_one(keys, tokenizer, hf_model):
    port = pick_free_tcp_port()
    node1 = _start_node_1(port, keys[0])  # waits for node 0 to listen
    server = None
    try:
        server = start_server(args=_node(0, port, keys[0]))
        prompt = "The three primary colours are"
        resp = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            },
            headers=server.auth,
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        expected = hf_greedy(hf_model, choice["prompt_token_ids"], 8, tokenizer.eos_ids)
        assert choice["token_ids"] == expected
        # rank 1 runs under node 1, not under node 0's server
        assert "kernels.tensor_parallel" in _children(node1.pid)
        assert "kernels.tensor_parallel" not in _children(server.process.pid)
    finally:
        if server is not None:
            stop_server(server)
        node1.send_signal(signal.SIGTERM)
        out, _ = node1.communicate(timeout=60)
    assert node1.returncode == 0, out
    assert session_gone(node1.pid)


def test_a_node_with_another_key_is_refused_naming_it(keys, monkeypatch):
    port = pick_free_tcp_port()
    # node 0 starts (it waits for node 1 up to its join timeout, listening meanwhile)
    node0 = subprocess.Popen(
        [sys.executable, "-m", "actors.app.cli", "serve", "--port", str(pick_free_tcp_port())]
        + _node(0, port, keys[0], "--set", "parallel.join_timeout_s=60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        node1 = _start_node_1(port, keys[1])
        out, _ = node1.communicate(timeout=60)
    finally:
        os.killpg(node0.pid, signal.SIGKILL)
        node0.wait()
    assert node1.returncode == 1
    assert f"127.0.0.1:{port} does not answer through CURVE" in out, out
    assert "curve_secret_file is not node 0's key" in out


def test_a_wrong_dist_init_addr_fails_naming_it(keys):
    port = pick_free_tcp_port()
    node1 = _start_node_1(port, keys[0], "--set", "parallel.join_timeout_s=1")
    out, _ = node1.communicate(timeout=60)
    assert node1.returncode == 1
    assert f"nothing listens at 127.0.0.1:{port} (--dist-init-addr)" in out, out
    # node 0 given an address that is not its own fails its start, naming it
    node0 = subprocess.run(
        [sys.executable, "-m", "actors.app.cli", "serve", "--port", str(pick_free_tcp_port())]
        + _node(0, 29999, keys[0], host="192.0.2.1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert node0.returncode != 0
    assert "cannot listen at 192.0.2.1:29999 (--dist-init-addr)" in node0.stderr + node0.stdout


def _children(pid: int) -> str:
    return subprocess.run(
        ["ps", "-ww", "-o", "args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
