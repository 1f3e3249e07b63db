"""A real `bin/engine serve` process for the gateway and ZeroMQ client tests.

`start_server` runs `python -m actors.app.cli serve` (HTTP gateway + ZeroMQ endpoint, API
key on, KV debug checks on) as a subprocess and waits for /health 200; `stop_server` sends
SIGTERM and asserts the process exits with status 0 within 15 s, leaving no process of its
session behind. The shared `server` fixture (tests/e2e/conftest.py) is one such process for
the whole session. Helpers read /metrics and wait for the engine to go idle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from transport.address import pick_free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "kvactor-test-key"
MODEL_NAME = "gemma-3-270m"
NUM_PAGES = 512
CONTEXT_LEN = 2048
PAGE_SIZE = 16
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0


@dataclass
class ServerHandle:
    base_url: str  # http://127.0.0.1:<port>
    zmq_address: str  # tcp://127.0.0.1:<port>
    api_key: str
    process: subprocess.Popen
    log_path: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def start_server(
    *,
    api_key: str = API_KEY,
    extra: list[str] | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ServerHandle:
    """`extra`: more --set pairs; `args`: more command-line arguments (a MODEL, flags)."""
    port = pick_free_tcp_port()
    zmq_port = pick_free_tcp_port(exclude={port})
    sets = [
        f"kv.num_pages={NUM_PAGES}",
        f"kv.context_len={CONTEXT_LEN}",
        f"kv.page_size={PAGE_SIZE}",
        "kv.max_rows=40",
        "scheduler.max_running_requests=32",
        "scheduler.chunk_size=256",
        "engine.debug_checks=true",
        # fp32: the tests compare texts across batch compositions (n > 1 vs alone, HTTP vs
        # ZeroMQ), which batch invariance guarantees in fp32 (tests/test_batch_invariance.py).
        "model.dtype=float32",
        "model.linear=aten",  # exact fp32 weights: lm-eval's scores are compared with HF's
        "model.threads=1",
        'server.allowed_origins=["http://app.example"]',
        "server.sse_keepalive_s=0.05",  # every stream then carries keep-alive comments
        *(extra or []),
    ]
    cmd = [
        sys.executable,
        "-m",
        "actors.app.cli",
        "serve",
        "--port",
        str(port),
        "--zmq",
        f"tcp://127.0.0.1:{zmq_port}",
        "--api-key",
        api_key,
    ]
    for s in sets:
        cmd += ["--set", s]
    cmd += args or []
    log = tempfile.NamedTemporaryFile(prefix="kvactor-server-", suffix=".log", delete=False)
    process = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    log.close()
    handle = ServerHandle(
        base_url=f"http://127.0.0.1:{port}",
        zmq_address=f"tcp://127.0.0.1:{zmq_port}",
        api_key=api_key,
        process=process,
        log_path=Path(log.name),
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{handle.log_tail()}")
        try:
            if httpx.get(f"{handle.base_url}/health", timeout=2.0).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(handle, check=False)
            raise RuntimeError(
                f"server not healthy after {START_TIMEOUT_S} s:\n{handle.log_tail()}"
            )
        time.sleep(0.25)


def stop_server(handle: ServerHandle, *, check: bool = True) -> None:
    """SIGTERM; with `check`, assert a clean exit (status 0, no process left in its group)."""
    process = handle.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if check:
            pytest.fail(f"server ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{handle.log_tail()}")
        return
    leftovers = not session_gone(process.pid, timeout_s=5.0)
    if leftovers:
        os.killpg(process.pid, signal.SIGKILL)
    if check:
        assert code == 0, f"server exited with {code}:\n{handle.log_tail()}"
        assert not leftovers, "processes of the server's session outlived it"
    if code == 0 and not leftovers:
        handle.log_path.unlink(missing_ok=True)  # kept (for reading) after a failure


def session_gone(sid: int, timeout_s: float = 10.0) -> bool:
    """True once no live process (zombies awaiting a reaper do not count) is left in the
    server's session."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            state, session = fields[0], int(fields[3])
            if session == sid and state != "Z":
                alive.append(int(entry))
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# ---- reading the server's state -------------------------------------------------------------


def scrape_metrics(handle: ServerHandle, model_name: str = MODEL_NAME) -> dict[str, float]:
    """/metrics parsed by `prometheus_client.parser`, as {"name{labels}": value}.

    Every kvactor: and vllm: series carries `model_name` (checked here); keys leave it out.
    Series with an `endpoint` label are summed over endpoints under keys without it; the
    per-endpoint samples are kept too, under keys with it.
    """
    resp = httpx.get(f"{handle.base_url}/metrics", timeout=10.0)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.startswith(("kvactor:", "vllm:")):
                assert labels.pop("model_name", None) == model_name, sample
            inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
            out[f"{sample.name}{{{inner}}}" if inner else sample.name] = sample.value
            if labels.pop("endpoint", None) is not None:
                inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
                key = f"{sample.name}{{{inner}}}" if inner else sample.name
                out[key] = out.get(key, 0.0) + sample.value
    return out


KV_KEYS = (
    'kvactor:kv_pages{state="free"}',
    'kvactor:kv_pages{state="held"}',
    'kvactor:kv_pages{state="tree"}',
    'kvactor:kv_pages{state="session"}',
    "kvactor:kv_request_records",
    "kvactor:kv_held_rows",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "kvactor:num_requests_prefilling",
)


def engine_figures(handle: ServerHandle) -> dict[str, float]:
    m = scrape_metrics(handle)
    return {k: m[k] for k in KV_KEYS}


def is_idle(figures: dict[str, float]) -> bool:
    return (
        figures['kvactor:kv_pages{state="held"}'] == 0
        and figures["kvactor:kv_request_records"] == 0
        and figures["vllm:num_requests_running"] == 0
        and figures["vllm:num_requests_waiting"] == 0
        and figures["kvactor:num_requests_prefilling"] == 0
    )


def wait_idle(handle: ServerHandle, timeout_s: float = 30.0) -> tuple[dict[str, float], float]:
    """Poll /metrics until no request runs or holds KV; (figures, seconds waited)."""
    t0 = time.monotonic()
    while True:
        figures = engine_figures(handle)
        waited = time.monotonic() - t0
        if is_idle(figures):
            return figures, waited
        if waited > timeout_s:
            raise AssertionError(f"engine not idle after {timeout_s} s: {figures}")
        time.sleep(0.05)
