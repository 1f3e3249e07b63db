"""`bin/engine serve --nnodes K --node-rank J` for J > 0: a machine that only runs ranks.

It asks node 0 for the group's settings at `--dist-init-addr` (ZeroMQ with CURVE,
`transport/rendezvous.py`), starts its share of the ranks (`kernels/tensor_parallel.py`;
ranks J * N/K ... (J + 1) * N/K - 1, pinned to this machine's cores) and waits on them. When
they end (node 0 stopped, or restarted its runner and formed a new group) it asks again;
when node 0 stops answering it exits 1 naming why. SIGTERM / SIGINT stop its ranks and
exit 0. No HTTP server, scheduler or KV pool runs here: node 0 holds the control plane.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading

from actors.app.config import EngineConfig
from actors.runtime.logging import get_logger

_log = get_logger("node")


def serve_node(cfg: EngineConfig) -> int:
    from kernels.tensor_parallel import (
        RankSettings,
        core_placement,
        cuda_gpus,
        start_rank_processes,
        stop_ranks,
    )
    from transport.rendezvous import RendezvousError, request_admission
    from transport.security import read_curve_secret

    par = cfg.parallel
    per_node = par.tensor_parallel_size // par.nnodes
    ranks = range(par.node_rank * per_node, (par.node_rank + 1) * per_node)
    try:
        secret = read_curve_secret(par.curve_secret_file)
    except ValueError as exc:
        print(f"bin/engine: {exc}", file=sys.stderr, flush=True)
        return 1
    import torch

    gpus_here = torch.cuda.device_count()  # node 0 refuses a CUDA group's node with too few
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    while not stopping.is_set():
        try:
            reply = request_admission(
                par.dist_init_addr,
                secret,
                par.node_rank,
                par.join_timeout_s,
                stopping.is_set,
                about={"world": par.tensor_parallel_size, "nnodes": par.nnodes, "gpus": gpus_here},
            )
        except RendezvousError as exc:
            print(f"bin/engine: node {par.node_rank}: {exc}", file=sys.stderr, flush=True)
            return 1
        if reply is None:  # stopped while waiting
            return 0
        settings = RankSettings(**reply["settings"])
        placement, threads, how = core_placement(per_node, sorted(os.sched_getaffinity(0)))
        cores = [list(c) for c in settings.cores]
        for rank, mine in zip(ranks, placement):
            cores[rank] = mine
        gpus = list(settings.gpus)
        if settings.device == "cuda":  # this machine's GPUs, one per rank
            try:
                for rank, gpu in zip(ranks, cuda_gpus(per_node, gpus_here)):
                    gpus[rank] = gpu
            except ValueError as exc:
                print(f"bin/engine: node {par.node_rank}: {exc}", file=sys.stderr, flush=True)
                return 1
        settings = dataclasses.replace(
            settings, cores=cores, gpus=gpus, threads=cfg.model.threads or threads
        )
        _log.info(
            "node admitted",
            node_rank=par.node_rank,
            ranks=list(ranks),
            rendezvous=par.dist_init_addr,
            rank_cores=placement,
            placement=how,
            rank_gpus=[gpus[r] for r in ranks] if settings.device == "cuda" else None,
        )
        processes: list = []
        start_rank_processes(settings, ranks, processes)
        while not stopping.wait(0.25) and all(p.poll() is None for p in processes):
            pass
        stop_ranks(processes)
        if not stopping.is_set():
            codes = [p.returncode for p in processes]
            _log.warning("ranks ended; asking node 0 again", exit_codes=codes)
    return 0
