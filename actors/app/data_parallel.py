"""`serve --data-parallel-size N` and `serve --role router --replica URL ...`: the router
(`actors/router.py`) on the server's host and port, in front of N replicas.

With `--data-parallel-size N` this process starts the N replicas itself: each is
`bin/engine serve` with the same model and settings on 127.0.0.1 and a port the OS reports
free (logged), its own process group, OMP_NUM_THREADS = cores / N, and on CUDA GPUs of its
own (`replica_gpus`: replica i sees the visible GPUs [i T, (i + 1) T) for
`tensor_parallel_size` T, as SGLang's data parallelism places them). The router starts once
every replica answers /health. A replica that exits during its start fails the start,
naming it, unless its port was taken meanwhile by another process (the port is free when
chosen, but a replica binds it only after loading the model): that replica is started
again on another port, up to START_ATTEMPTS times. A replica counts as up only when its
/health reports the instance id it was started with (`server.instance_id`), so a server
that took its port is never mistaken for it. SIGTERM / SIGINT stop the router,
then drain the replicas (SIGTERM each, as their own drain expects); each replica also
gets SIGTERM if the router's process dies. A replica that dies later is taken out by the
router; the others serve on. With `--role router` the replicas are engines started
elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import httpx

from actors.app.config import EngineConfig
from actors.runtime.logging import get_logger
from kernels.tensor_parallel import die_with_parent
from transport.address import pick_free_tcp_port

_log = get_logger("data_parallel")

START_TIMEOUT_S = 900.0
DRAIN_WAIT_S = 60.0
START_ATTEMPTS = 3


def replica_argv(argv: list[str], port: int, instance_id: str) -> list[str]:
    """`serve` arguments for one replica: the router's own, minus the flags that make a
    router, with the replica's host and port, and the instance id its /health reports."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--data-parallel-size", "--port", "--host", "--role", "--replica", "--zmq"):
            skip = "=" not in arg
            continue
        out.append(arg)
    # The flag beats --set, the environment and the config file: a replica never routes.
    return [
        *out,
        *("--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1"),
        *("--set", f"server.instance_id={instance_id}"),
    ]


def replica_ports(count: int, exclude: set[int]) -> list[int]:
    """`count` distinct ports the OS reports free on loopback, none in `exclude`.

    Not the router's port + 1...: a fixed neighbour may belong to any other process."""
    out: list[int] = []
    for _ in range(count):
        out.append(pick_free_tcp_port(exclude={*exclude, *out}))
    return out


def port_taken(port: int) -> bool:
    """Whether another socket listens on `port` on loopback right now (bound as the
    replica binds, so a port in TIME_WAIT is not taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def is_up(url: str, instance_id: str) -> bool:
    """`url` answers /health 200 as the replica started with `instance_id` (another
    server that took its port answers without it, or with its own)."""
    try:
        resp = httpx.get(url + "/health", timeout=2.0)
        return resp.status_code == 200 and resp.json().get("instance") == instance_id
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES names them (indices or
    UUIDs): its own CUDA_VISIBLE_DEVICES where set, else every GPU torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def replica_gpus(count: int, per_replica: int, visible: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of `count` replicas of `per_replica` GPUs (one per
    tensor-parallel rank): consecutive runs of `visible`, none shared (two engines on one
    GPU would each plan their KV pool from the same free memory). A ValueError names the
    counts where there are too few."""
    need = count * per_replica
    if len(visible) < need:
        raise ValueError(
            f"{count} replicas of {per_replica} GPU(s) each need {need} GPUs; "
            f"{len(visible)} visible ({','.join(visible) or 'none'})"
        )
    return [",".join(visible[i * per_replica : (i + 1) * per_replica]) for i in range(count)]


def start_replicas(cfg: EngineConfig, argv: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    import torch

    from kernels.device import choose_device

    count = cfg.parallel.data_parallel_size
    threads = max(1, len(os.sched_getaffinity(0)) // count)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("KVACTOR_PARALLEL_DATA_PARALLEL_SIZE", None)
    ids = [f"replica-{i}-{secrets.token_hex(8)}" for i in range(count)]
    gpus: list[str] = []
    try:
        if cfg.model.device == "auto":  # as choose_device's, without naming the GPU (no
            on_cuda = torch.cuda.is_available()  # CUDA state here: the router runs no model)
        else:  # a device that is not there fails here, naming it
            on_cuda = choose_device(cfg.model.device)[0] == "cuda"
        if on_cuda:
            gpus = replica_gpus(count, cfg.parallel.tensor_parallel_size, visible_gpus())
    except ValueError as exc:
        raise SystemExit(f"bin/engine: --data-parallel-size {count}: {exc}") from None

    def launch(i: int, port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "actors.app.cli", "serve", *replica_argv(argv, port, ids[i])]
        own = dict(env, CUDA_VISIBLE_DEVICES=gpus[i]) if gpus else env
        return subprocess.Popen(
            cmd, env=own, start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM)
        )

    processes: list[subprocess.Popen] = []
    try:
        ports = replica_ports(count, {cfg.server.port})
        for i, port in enumerate(ports):
            processes.append(launch(i, port))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        attempts = [1] * count
        _log.info("replicas starting", replicas=urls, threads_each=threads, gpus=gpus or None)
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(count))
        while pending:
            for i in list(pending):
                if processes[i].poll() is not None:
                    if attempts[i] < START_ATTEMPTS and port_taken(ports[i]):
                        (port,) = replica_ports(1, {cfg.server.port, *ports})
                        _log.warning(
                            "replica port taken", replica=i, port=ports[i], retry_port=port
                        )
                        with contextlib.suppress(ProcessLookupError):  # what it left behind
                            os.killpg(processes[i].pid, signal.SIGKILL)
                        ports[i], urls[i] = port, f"http://127.0.0.1:{port}"
                        processes[i] = launch(i, port)
                        attempts[i] += 1
                        deadline = max(deadline, time.monotonic() + START_TIMEOUT_S / 2)
                        continue
                    raise SystemExit(
                        f"bin/engine: replica {i} ({urls[i]}) exited with code "
                        f"{processes[i].returncode} during its start"
                    )
                if is_up(urls[i], ids[i]):
                    pending.discard(i)
            if time.monotonic() > deadline:
                raise SystemExit(f"bin/engine: replicas {sorted(pending)} not healthy in time")
            time.sleep(0.25)
    except BaseException:
        stop_replicas(processes)
        raise
    return processes, urls


def stop_replicas(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each (they drain), then wait; kill what is left after DRAIN_WAIT_S."""
    for p in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + DRAIN_WAIT_S
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def serve_router(cfg: EngineConfig, argv: list[str], urls: list[str]) -> int:
    """Run the router (starting the replicas first unless `urls` names them)."""
    import uvicorn

    from actors.frontends.http.app import MAX_BODY_BYTES
    from actors.frontends.http.protocol import guarded_h11_protocol
    from actors.router import Router

    processes: list[subprocess.Popen] = []
    if not urls:
        processes, urls = start_replicas(cfg, argv)
    try:
        router = Router(urls, max_body_bytes=MAX_BODY_BYTES, api_key=cfg.server.api_key)
        print(
            f"kvactor router on http://{cfg.server.host}:{cfg.server.port} "
            f"in front of {', '.join(urls)}",
            file=sys.stderr,
            flush=True,
        )
        srv = cfg.server
        uvicorn.run(
            router,
            host=srv.host,
            port=srv.port,
            log_level="warning",
            # the engine's own HTTP limits: a head within header_timeout_s, at most
            # max_connections open, idle keep-alive connections closed
            http=guarded_h11_protocol(srv.header_timeout_s, srv.max_connections),
            timeout_keep_alive=max(1, round(srv.keepalive_timeout_s)),
            limit_concurrency=srv.max_connections,
        )
    finally:
        stop_replicas(processes)
    return 0
