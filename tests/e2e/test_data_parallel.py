"""`serve --data-parallel-size 2`: the router (actors/router.py) in front of two complete
engines it starts. A streaming session's turns all land on the replica that holds its KV
(each later turn finds its history cached); a long prefix sent again lands where it was
cached, also when the router learnt of it only from that replica's tree digest; killing
one replica leaves the other serving, with /health "degraded"; the router's /metrics
counts each rule per replica. `--role router` fronts engines started elsewhere, passing
their API key through, and reports a replica nobody serves as down. A replica whose port
another process took before it bound starts again on another."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.engine_fixtures import natural_text, tiny_llama_folder
from tests.e2e.server_fixtures import (
    MODEL_NAME,
    pick_free_tcp_port,
    session_gone,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.model]


@pytest.fixture(scope="module")
def router():
    server = start_server(args=["--data-parallel-size", "2"], extra=["kv.num_pages=256"])
    replicas = _replicas(server)
    try:
        yield server
    finally:
        stop_server(server, check=False)
    for pid in replicas:  # the router drained them on its way out
        assert session_gone(pid)


def _replicas(server) -> list[int]:
    children = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.process.pid)],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    pids = [int(line.split()[0]) for line in children if "actors.app.cli serve" in line]
    assert len(pids) == 2, children
    return pids


def _complete(server, prompt: str, **extra) -> dict:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra},
        headers=server.auth,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached(answer: dict) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def _routed(server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvactor_router_routed_total{"):
            labels, value = line.split("} ")
            fields = dict(part.split("=") for part in labels.split("{")[1].split(","))
            out[(fields["replica"].strip('"'), fields["reason"].strip('"'))] = float(value)
    return out


def test_a_sessions_turns_stay_on_its_replica(router):
    resp = httpx.post(f"{router.base_url}/v1/sessions", json={}, headers=router.auth, timeout=30)
    assert resp.status_code == 200, resp.text
    sid = resp.json()["id"]
    history = natural_text()[:600]
    for turn in range(3):
        history += f" Turn {turn}: more of the story follows here."
        answer = _complete(router, history, session_id=sid)
        if turn:
            assert _cached(answer) > 100, answer["usage"]  # its history was on that replica
        history += answer["choices"][0]["text"]
    routed = _routed(router)
    sessions = {replica: n for (replica, reason), n in routed.items() if reason == "session"}
    assert list(sessions.values()) == [3.0], routed  # every turn, one replica


def test_a_repeated_long_prefix_lands_where_it_is_cached(router):
    shared = natural_text()[2000:4000]
    first = _complete(router, shared + " First question: who?")
    _complete(router, natural_text()[6000:6100])  # another prompt (least load: the other)
    second = _complete(router, shared + " Second question: why?")
    assert _cached(first) < 100
    assert _cached(second) > 300, second["usage"]
    assert any(reason == "cached_prefix" for _, reason in _routed(router))


def _cached_prefixes(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    prefix = "kvactor_router_replica_cached_prefixes{"
    return {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def test_the_router_reads_the_replicas_own_trees(router):
    """A chat sent straight to one replica (the router never saw it) is in that
    replica's tree; the router learns it from the replica's digest, and the same
    conversation sent through the router lands there, cached."""
    urls = httpx.get(f"{router.base_url}/health", timeout=5).json()["replicas"]
    target = urls[1]
    before = _cached_prefixes(router)[target]
    messages = [{"role": "user", "content": natural_text()[8000:10000]}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "temperature": 0}
    direct = httpx.post(
        f"{target}/v1/chat/completions", json=body, headers=router.auth, timeout=120
    )
    assert direct.status_code == 200, direct.text
    digest = httpx.get(f"{target}/cache_digest", headers=router.auth, timeout=5).json()
    assert digest["block_tokens"] == 64 and len(digest["hashes"]) > 0
    deadline = time.monotonic() + 10
    while _cached_prefixes(router)[target] < before + 5:  # the next polls read it
        assert time.monotonic() < deadline, _cached_prefixes(router)
        time.sleep(0.2)
    routed = _routed(router).get((target, "cached_prefix"), 0)
    answer = httpx.post(
        f"{router.base_url}/v1/chat/completions", json=body, headers=router.auth, timeout=120
    ).json()
    assert _cached(answer) > 300, answer["usage"]
    assert _routed(router)[(target, "cached_prefix")] == routed + 1


def test_a_prefix_past_the_sliding_window_is_not_routed_as_cached(router):
    """Gemma 3's sliding layers free an answer's KV once the window (512 tokens) passes
    it. A prompt that shares that answer's start but not its end would be prefilled from
    the beginning (the window its next query reads is gone): the replica's digest marks
    those prefixes as dead ends, and the router does not count them as cached."""
    import base64

    from kvcore.prefix_digest import unpack

    target = httpx.get(f"{router.base_url}/health", timeout=5).json()["replicas"][0]
    story = "Once upon a time, in a small village by the sea,"
    body = {"model": MODEL_NAME, "prompt": story, "max_tokens": 720, "temperature": 0}
    body["ignore_eos"] = True
    long = httpx.post(f"{target}/v1/completions", json=body, headers=router.auth, timeout=300)
    assert long.status_code == 200, long.text
    text = long.json()["choices"][0]["text"]
    digest = httpx.get(f"{target}/cache_digest", headers=router.auth, timeout=5).json()
    assert len(unpack(base64.b64decode(digest.get("dead") or ""))) >= 4, digest
    deadline = time.monotonic() + 10
    while _cached_prefixes(router)[target] < 10:  # the router has read that digest
        assert time.monotonic() < deadline, _cached_prefixes(router)
        time.sleep(0.2)
    edited = story + text[: len(text) // 2] + " And then, suddenly, everything changed."
    routed = _routed(router).get((target, "cached_prefix"), 0)
    answer = _complete(router, edited)
    assert _routed(router).get((target, "cached_prefix"), 0) == routed, _routed(router)
    # right: wherever it went (idle replicas: likely the target), no block of it was reused
    assert _cached(answer) < 64, answer["usage"]


def test_a_client_that_leaves_frees_its_replica(router):
    """A stream dropped by its client after the first event: the router closes the
    replica's connection (so the replica aborts), nothing stays in flight, and the next
    client is served."""
    body = {"model": MODEL_NAME, "prompt": "A long tale:", "max_tokens": 1500, "stream": True}
    body["ignore_eos"] = True
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", f"{router.base_url}/v1/completions", json=body, headers=router.auth
        ) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())  # the first event, then the client leaves
    deadline = time.monotonic() + 10  # far less than 1,500 tokens take
    while True:
        metrics = httpx.get(f"{router.base_url}/metrics", timeout=5).text
        busy = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvactor_router_replica_in_flight{")
        ]
        if busy and sum(busy) == 0:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.1)
    assert _complete(router, "Still served:")["usage"]["completion_tokens"] == 4


def test_a_dead_replica_leaves_the_other_serving(router):
    replicas = _replicas(router)
    os.killpg(replicas[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{router.base_url}/health", timeout=5)).json()["status"] != (
        "degraded"
    ):
        assert time.monotonic() < deadline, health.text
        time.sleep(0.25)
    assert health.status_code == 200 and len(health.json()["down"]) == 1
    for i in range(3):  # every request goes to the replica left
        assert _complete(router, f"After the loss, request {i}:")["choices"][0]["text"]


def test_a_router_in_front_of_engines_started_elsewhere():
    engine = start_server()
    dead = f"http://127.0.0.1:{pick_free_tcp_port()}"  # nobody serves there
    port = pick_free_tcp_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "actors.app.cli", "serve", "--role", "router", "--port", str(port)]
        + ["--replica", engine.base_url, "--replica", dead],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{base}/health", timeout=2)
                if health.json().get("status") == "degraded":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.25)
        assert health.status_code == 200 and health.json()["down"] == [dead]
        resp = httpx.post(
            f"{base}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0},
            headers=engine.auth,  # the engine's own API key passes through the router
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
        unauthorized = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=60)
        assert unauthorized.status_code == 401
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=30)
        stop_server(engine)


def test_a_replica_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The port is free when chosen and bound only after the model loads: another server
    that takes it meanwhile (a parallel test run's did) must not fail the start, nor be
    taken for the replica though its /health answers 200."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from actors.app import data_parallel
    from actors.app.config import load_config

    class OtherServer(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = b'{"status": "ok", "actors": []}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    folder = tiny_llama_folder(tmp_path)
    other = ThreadingHTTPServer(("127.0.0.1", 0), OtherServer)
    Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    real, calls = data_parallel.replica_ports, []

    def first_one_taken(count: int, exclude: set[int]) -> list[int]:
        calls.append(count)
        ports = real(count, exclude)
        return [taken, *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(data_parallel, "replica_ports", first_one_taken)
    argv = [str(folder), "--max-model-len", "256", "--data-parallel-size", "2"]
    argv += ["--set", "kv.num_pages=64"]
    cfg = load_config(None, ["parallel.data_parallel_size=2", "kv.num_pages=64"])
    try:
        processes, urls = data_parallel.start_replicas(cfg, argv)
        try:
            assert calls == [2, 1]  # one more port, for the replica that lost its own
            assert len(set(urls)) == 2 and f"http://127.0.0.1:{taken}" not in urls
            for url in urls:
                health = httpx.get(f"{url}/health", timeout=5).json()
                assert health["instance"].startswith("replica-"), health
        finally:
            data_parallel.stop_replicas(processes)
    finally:
        other.shutdown()
        other.server_close()
    assert all(p.returncode is not None for p in processes)
