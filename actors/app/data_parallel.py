"""`serve --data-parallel-size N` and `serve --role router --replica URL ...`: the router
(`actors/router.py`) on the server's host and port, in front of N replicas.

With `--data-parallel-size N` this process starts the N replicas itself: each is
`bin/engine serve` with the same model and settings on 127.0.0.1 and a port the OS reports
free (logged), its own process group, OMP_NUM_THREADS = cores / N. The router starts once
every replica answers /health. A replica that exits during its start fails the start,
naming it, unless its port was taken meanwhile by another process (the port is free when
chosen, but a replica binds it only after loading the model): that replica is started
again on another port, up to START_ATTEMPTS times. SIGTERM / SIGINT stop the router,
then drain the replicas (SIGTERM each, as their own drain expects); each replica also
gets SIGTERM if the router's process dies. A replica that dies later is taken out by the
router; the others serve on. With `--role router` the replicas are engines started
elsewhere.
"""

from __future__ import annotations

import contextlib
import os
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


def replica_argv(argv: list[str], port: int) -> list[str]:
    """`serve` arguments for one replica: the router's own, minus the flags that make a
    router, with the replica's host and port."""
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
    return [*out, "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1"]


def replica_ports(router_port: int, count: int) -> list[int]:
    """`count` distinct ports the OS reports free on loopback, none of them the router's.

    Not router_port + 1...: a fixed neighbour may belong to any other process."""
    ports: set[int] = set()
    out = []
    for _ in range(count):
        port = pick_free_tcp_port(exclude={router_port, *ports})
        ports.add(port)
        out.append(port)
    return out


def port_taken(port: int) -> bool:
    """Whether another socket holds `port` on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def start_replicas(cfg: EngineConfig, argv: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    count = cfg.parallel.data_parallel_size
    threads = max(1, len(os.sched_getaffinity(0)) // count)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("KVACTOR_PARALLEL_DATA_PARALLEL_SIZE", None)

    def launch(port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "actors.app.cli", "serve", *replica_argv(argv, port)]
        return subprocess.Popen(
            cmd, env=env, start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM)
        )

    ports = replica_ports(cfg.server.port, count)
    processes = [launch(port) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    attempts = [1] * count
    _log.info("replicas starting", replicas=urls, threads_each=threads)
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(count))
    while pending:
        for i in list(pending):
            if processes[i].poll() is not None:
                if attempts[i] < START_ATTEMPTS and port_taken(ports[i]):
                    (port,) = replica_ports(cfg.server.port, 1)
                    _log.warning("replica port taken", replica=i, port=ports[i], retry_port=port)
                    ports[i], urls[i] = port, f"http://127.0.0.1:{port}"
                    processes[i] = launch(port)
                    attempts[i] += 1
                    continue
                stop_replicas(processes)
                raise SystemExit(
                    f"bin/engine: replica {i} ({urls[i]}) exited with code "
                    f"{processes[i].returncode} during its start"
                )
            try:
                if httpx.get(urls[i] + "/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            stop_replicas(processes)
            raise SystemExit(f"bin/engine: replicas {sorted(pending)} not healthy in time")
        time.sleep(0.25)
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
