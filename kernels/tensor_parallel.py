"""Tensor parallelism on torch.distributed: one model split across N rank processes.

Megatron's split, as vLLM and SGLang do it, on torch.distributed process groups:
  * q/k/v and gate/up are column-parallel: rank r computes its own heads and its own slice
    of the MLP's intermediate features, with no communication;
  * o_proj and down_proj are row-parallel: each rank multiplies its slice and one
    all-reduce sums the partial products (a bias is added by rank 0 alone);
  * the embedding and the LM head are vocabulary-parallel: rank r holds rows
    [r * ceil(V/N), (r + 1) * ceil(V/N)) (the last padded with zeros); a lookup is summed over the
    ranks, and the logits are gathered once per step, on rank 0, which samples;
  * KV heads are split across the ranks; a model with fewer KV heads than ranks (Gemma 3
    270M has one) gives every rank a copy of the head its query heads read.
Each rank holds its share of the paged KV pool (its KV heads, every page), so the
allocator's page numbers mean the same on every rank and one `ForwardBatch` drives them
all: rank 0 (the runner) sends each batch to the others before computing its own share.

Two groups, as vLLM's: a gloo *control* group carries rank 0's commands (pickled batches)
and the start's votes and barriers, on the CPU; the step's collectives (the all-reduces and
the logits' gather) go over the *data* group: the control group itself on the CPU, NCCL on
CUDA (one GPU per rank, `RankSettings.gpus`). Both rendezvous at rank 0's TCPStore, the
data group under its own key prefix.

Invariant: every rank runs the same sequence of collectives. A rank that fails a step
cannot rejoin it, so any failure breaks the group (`TpGroup.broken`) and the runner
restarts or stops as after a crash. This module knows nothing of actors: `worker_main` is
a rank's whole life (join, load its shard, follow rank 0's commands).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.config import ModelConfig

# A collective waits this long for a peer before failing (a dead peer is noticed at once:
# its sockets close). A worker waits for rank 0's next command without a limit.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
IDLE_TIMEOUT = datetime.timedelta(days=3650)
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


class TensorParallelError(RuntimeError):
    """A model or setting that cannot be split as asked; the message names the reason."""


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def gloo_group(store, rank: int, world: int, host: str):
    """A gloo process group whose ranks talk over this machine's interface towards the
    rendezvous `host` (loopback for the ranks of one machine), with COLLECTIVE_TIMEOUT."""
    options = dist.ProcessGroupGloo._Options()
    device = dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))
    options._devices = [device]
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, options)


DATA_BACKENDS = ("", "gloo", "nccl")  # "": the control group carries the data too


def data_group(store, rank: int, world: int, backend: str, host: str):
    """The step's collectives' own group, formed beside the control group at the same
    rendezvous (under the key prefix "data/"): "nccl" for CUDA tensors (this rank's GPU
    set as current first), or a second "gloo" group. Every rank forms it at the same point."""
    prefixed = dist.PrefixStore("data/", store)
    if backend == "gloo":
        return gloo_group(prefixed, rank, world, host)
    if backend != "nccl":
        raise TensorParallelError(f"the data group's backend must be one of {DATA_BACKENDS}")
    if not dist.is_nccl_available():
        raise TensorParallelError(
            f"this torch ({torch.__version__}) has no NCCL: CUDA ranks cannot form their group"
        )
    # Read when the group is made. A failed or timed-out collective then aborts the
    # communicator (2: CleanUpOnly; `TpGroup.check` finds it after the step) where torch's
    # default (3) has its watchdog end the whole process, the engine's clients with it.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupNCCL(prefixed, rank, world, options)


class TpGroup:
    """One rank's handle on the group: the collectives the split model needs (on the data
    group), and rank 0's commands to the others (pickled, broadcast over the control group)."""

    def __init__(self, pg, rank: int, world: int, store=None) -> None:
        self.pg = pg  # the control group (gloo, CPU tensors)
        self.data_pg = pg  # the step's collectives (`attach_data_group`)
        self.data_backend = "gloo"
        self.device = torch.device("cpu")  # where the data group's tensors live
        self.rank = rank
        self.world = world
        self.store = store  # the rendezvous (rank 0 serves it) lives as long as the group
        self.broken: str | None = None  # why a collective failed; the group is then unusable

    @classmethod
    def join(
        cls, host: str, port: int, rank: int, world: int, timeout: datetime.timedelta | None = None
    ) -> TpGroup:
        """Join the group whose rendezvous rank 0 serves at host:port."""
        store = dist.TCPStore(host, port, world, False, timeout=timeout or JOIN_TIMEOUT)
        return cls(gloo_group(store, rank, world, host), rank, world, store)

    def attach_data_group(self, backend: str, host: str) -> None:
        """Form the data group (`data_group`) unless `backend` is "" (the control group
        carries the step's collectives). Every rank calls this at the same point."""
        if backend:
            self.data_pg = self._guard(
                "forming the data group",
                lambda: data_group(self.store, self.rank, self.world, backend, host),
            )
            self.data_backend = backend
            if backend == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())

    def abort(self, why: str) -> None:
        """With a data group of its own: break the group (`why`) and end that group's
        collectives in flight (NCCL's `abort`: a step waiting on a dead peer's GPU would
        otherwise wait until COLLECTIVE_TIMEOUT). With one gloo group, nothing: its
        collectives fail by themselves when a peer's sockets close. Blocks while NCCL tears
        its communicator down: call it off the event loop."""
        if self.data_pg is self.pg:
            return  # nothing to end: a step that finished its collectives stands
        if self.broken is None:
            self.broken = why  # first: a step that NCCL's abort cut short is not answered
        with contextlib.suppress(Exception):
            getattr(self.data_pg, "abort", lambda: None)()

    def check(self) -> None:
        """Raise TensorParallelError if the group is broken or its data group reports a
        failed collective. NCCL reports one to its watchdog, not to the step that waited on
        it (whose results are then garbage), so a step's results count only after this."""
        if self.broken is None and self.data_pg is not self.pg:
            try:
                error = self.data_pg.get_error()  # NCCL's; gloo raises at the collective
            except Exception:  # a backend or torch without it
                error = None
            name = getattr(error, "name", "SUCCESS")
            if name != "SUCCESS":
                self.broken = f"the {self.data_backend} data group reports {name}"
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group is broken: {self.broken}")

    def _guard(self, what: str, fn):
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            return fn()
        except Exception as exc:
            self.broken = f"{what} failed on rank {self.rank}: {exc}"
            raise TensorParallelError(self.broken) from exc

    def all_reduce(self, t: Tensor) -> Tensor:
        """`t` (on this rank's device) summed over the ranks on the data group, in place
        (every rank gets the sum)."""
        self._guard("all_reduce", lambda: self.data_pg.allreduce([t]).wait())
        return t

    def control_all_reduce(self, t: Tensor) -> Tensor:
        """`t` (a CPU tensor) summed over the ranks on the control group, in place."""
        self._guard("all_reduce", lambda: self.pg.allreduce([t]).wait())
        return t

    def gather_columns(self, local: Tensor, width: int) -> Tensor:
        """Rank 0: the ranks' `local` [n, w] side by side, cut to `width` columns. Other
        ranks: an unfilled [n, width] tensor (they never read logits)."""
        local = local.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self._guard("gather", lambda: self.data_pg.gather([], [local], opts).wait())
            return local.new_empty((local.shape[0], width))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self._guard("gather", lambda: self.data_pg.gather([parts], [local], opts).wait())
        return torch.cat(parts, dim=1)[:, :width]

    def send(self, command: object) -> None:
        """Rank 0: broadcast `command` to the other ranks."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._guard("send", lambda: (self._broadcast(size), self._broadcast(payload)))

    def receive(self) -> object:
        """Another rank: rank 0's next command (waits as long as rank 0 is alive)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._guard("receive", lambda: self._broadcast(size, IDLE_TIMEOUT))
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._guard("receive", lambda: self._broadcast(payload))
        return pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, t: Tensor, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timeout
        self.pg.broadcast([t], opts).wait()


# --- the split ------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """Which part of the model rank `rank` of `world` holds."""

    rank: int
    world: int
    num_heads: int  # the model's, all ranks together
    num_kv_heads: int
    intermediate: int
    vocab: int

    @property
    def heads(self) -> range:
        per = self.num_heads // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank's query heads read: its own share, or (fewer KV heads than
        ranks) a copy of the one head its query group reads."""
        if self.num_kv_heads >= self.world:
            per = self.num_kv_heads // self.world
            return range(self.rank * per, (self.rank + 1) * per)
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        first = self.heads.start // group
        return range(first, first + 1)

    @property
    def features(self) -> range:
        per = self.intermediate // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_rows(self) -> int:
        return -(-self.vocab // self.world)  # ceil: the last rank's rows padded with zeros

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def check_split(config: ModelConfig, world: int) -> None:
    """TensorParallelError naming what stops `config` from splitting `world` ways."""
    problems = []
    if config.num_heads % world:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % world and world % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of the ranks)")
    if config.intermediate % world:
        problems.append(f"an MLP of {config.intermediate} features")
    if problems:
        raise TensorParallelError(
            f"{config.arch} cannot be split across {world} ranks: {', '.join(problems)}"
        )


def split_of(config: ModelConfig, rank: int, world: int) -> Split:
    check_split(config, world)
    return Split(
        rank, world, config.num_heads, config.num_kv_heads, config.intermediate, config.vocab
    )


def rank_config(config: ModelConfig, split: Split) -> ModelConfig:
    """The config of one rank's share: its heads and MLP features (the KV pool and the
    attention backend are built from it); the vocabulary stays whole (logits are gathered)."""
    return dataclasses.replace(
        config,
        num_heads=len(split.heads),
        num_kv_heads=len(split.kv_heads),
        intermediate=len(split.features),
    )


def shard_state(state: dict[str, Tensor], config: ModelConfig, split: Split) -> dict[str, Tensor]:
    """A rank's tensors from the whole model's (stacked names: `qkv_proj`, `gate_up_proj`)."""
    hd = config.head_dim
    q_rows = _rows(split.heads, hd)
    kv_rows = _rows(split.kv_heads, hd)
    q_size, kv_size = config.q_size, config.kv_size
    qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    feats = torch.tensor(split.features, dtype=torch.int64)
    gate_up_rows = torch.cat([feats, config.intermediate + feats])
    out = {}
    for name, t in state.items():
        leaf = name.rsplit(".", 2)
        part = leaf[-2] if len(leaf) >= 2 else ""
        is_weight = name.endswith(".weight")
        if part == "qkv_proj":
            out[name] = t.index_select(0, qkv_rows)
        elif part == "gate_up_proj":
            out[name] = t.index_select(0, gate_up_rows)
        elif part in ("o_proj", "down_proj"):
            cols = q_rows if part == "o_proj" else feats
            if is_weight:
                out[name] = t.index_select(1, cols)
            else:  # a row-parallel bias is added once, after the sum
                out[name] = t if split.rank == 0 else torch.zeros_like(t)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(t, split)
        else:
            out[name] = t  # norms: every rank applies them to the whole hidden state
    return out


def _rows(heads: range, head_dim: int) -> Tensor:
    first = torch.tensor(heads, dtype=torch.int64)[:, None] * head_dim
    return (first + torch.arange(head_dim)).flatten()


def _vocab_rows(t: Tensor, split: Split) -> Tensor:
    rows = t[split.vocab_start : split.vocab_start + split.vocab_rows]
    if rows.shape[0] < split.vocab_rows:
        pad = t.new_zeros((split.vocab_rows - rows.shape[0], t.shape[1]))
        rows = torch.cat([rows, pad])
    return rows.contiguous()


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the embedding table; a lookup is each rank's rows (zero where the
    id is another rank's) summed over the ranks."""

    def __init__(self, weight: Tensor, start: int, group: TpGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(rows * mine[:, None].to(rows.dtype))


class GatheredLmHead:
    """A rank's LM head over its vocabulary rows; calls return the whole vocabulary's logits
    on rank 0 (gathered once per call) and an unfilled tensor of that shape elsewhere."""

    def __init__(self, local, group: TpGroup, vocab: int) -> None:
        self.local = local
        self.group = group
        self.vocab = vocab

    def __call__(self, hidden: Tensor) -> Tensor:
        return self.group.gather_columns(self.local(hidden), self.vocab)

    def __getattr__(self, name: str):  # plan, backend choice, ... of the local head
        return getattr(self.local, name)


def load_shard(
    path: str | None, dtype: torch.dtype, group: TpGroup
) -> tuple[ModelConfig, ModelConfig, nn.Module]:
    """(whole config, this rank's config, this rank's module). Each rank reads the
    checkpoint and keeps only its share."""
    from kernels.linear import stack_projections
    from kernels.models import MODEL_CLASSES, bind_weights, load_config, load_model_weights

    config = load_config(path)
    split = split_of(config, group.rank, group.world)
    local = rank_config(config, split)
    weights = load_model_weights(path, dtype)
    state = {n: t if t.dtype == dtype else t.to(dtype) for n, t in weights.items()}
    del weights
    state = shard_state(stack_projections(state), config, split)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.arch](dataclasses.replace(local, vocab=split.vocab_rows))
    expected = set(model.state_dict())
    model = bind_weights(model, local, state, expected - set(state), set(state) - expected)
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens.weight.data, split.vocab_start, group
    )
    return config, local, model


def parallelize(executor, group: TpGroup, vocab: int) -> None:
    """Make a rank's executor sum the row-parallel products and gather the logits."""
    executor.reduce = group.all_reduce
    executor.lm_head = GatheredLmHead(executor.lm_head, group, vocab)


class ParallelExecutor:
    """Rank 0's executor: each forward is sent to the other ranks, then computed here; the
    rest (the KV cache, the LM head's plan, ...) is the local executor's."""

    def __init__(self, local, group: TpGroup) -> None:
        self.local = local
        self.group = group

    def forward(self, batch) -> Tensor:
        self.group.send(("forward", (batch,)))
        return self._run(self.local.forward, batch)

    def forward_full(self, batch, full: list[bool]):
        self.group.send(("forward_full", (batch, full)))
        return self._run(self.local.forward_full, batch, full)

    def _run(self, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as exc:  # the other ranks are now out of step: the group is done
            if self.group.broken is None:
                self.group.broken = f"a step failed on rank 0: {exc}"
            raise

    def __getattr__(self, name: str):
        return getattr(self.local, name)


def probe_collectives(
    group: TpGroup, rows: int, hidden: int, columns: int, dtype: str, repeats: int
) -> tuple[float, float]:
    """Every rank: `repeats` all-reduces of [rows, hidden] in `dtype` (a row-parallel sum)
    and gathers of [rows, columns] fp32 (a rank's logits); rank 0 gets the median seconds
    of each (a step waits on every one of them, so the median, not the best, is its cost).
    Rank 0 sends ("probe", args) first, so that every rank runs it."""
    import statistics
    import time

    x = torch.ones(rows, hidden, dtype=getattr(torch, dtype), device=group.device)
    logits = torch.ones(rows, columns, device=group.device)
    done = torch.cuda.synchronize if group.device.type == "cuda" else lambda: None
    samples: list[list[float]] = [[], []]
    for _ in range(repeats):
        ops = (lambda: group.all_reduce(x), lambda: group.gather_columns(logits, 1))
        for k, op in enumerate(ops):
            start = time.perf_counter()
            op()
            done()  # a collective on the GPU has only been queued when `op` returns
            samples[k].append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


# --- the other ranks' processes --------------------------------------------------------


@dataclass
class RankSettings:
    """What a rank needs to build its share (rank 0 decides; JSON on the command line)."""

    model: str | None
    dtype: str
    attention: str
    linear: str
    num_pages: int
    swa_num_pages: int
    page_size: int
    max_rows: int
    row_capacity: int
    threads: int
    world: int
    cores: list[list[int]]  # per rank: the cores it is pinned to ([] = not pinned)
    host: str = "127.0.0.1"  # rank 0's rendezvous
    port: int = 0
    join_timeout_s: float = JOIN_TIMEOUT.total_seconds()  # the group forms within this
    device: str = "cpu"  # "cpu" | "cuda": where every rank computes
    gpus: list[int] = field(default_factory=list)  # CUDA: per rank, its GPU's
    # index on its own machine (each node fills in its ranks')
    data_backend: str = ""  # the step's collectives' group (DATA_BACKENDS): nccl on CUDA


def numa_nodes(cores: list[int]) -> list[list[int]]:
    """The machine's NUMA nodes as lists of the given `cores` (Linux sysfs; nodes holding
    none of them left out; [] where sysfs says nothing)."""
    from pathlib import Path

    mine = set(cores)
    nodes = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist")):
        listed = _cpulist(path.read_text())
        if listed & mine:
            nodes.append(sorted(listed & mine))
    return nodes


def _cpulist(text: str) -> set[int]:
    """ "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def core_placement(
    world: int, cores: list[int], nodes: list[list[int]] | None = None
) -> tuple[list[list[int]], int, str]:
    """(cores per rank, threads per rank, how): with at least as many NUMA nodes as ranks,
    rank r gets node r's cores (its memory is then local: SGLang's CPU backend places one
    rank per node too); else the cores split in contiguous runs; with fewer cores than
    ranks nobody is pinned and each rank gets one thread. `nodes` defaults to this
    machine's (`numa_nodes`)."""
    nodes = numa_nodes(cores) if nodes is None else nodes
    if len(nodes) >= world:
        per = min(len(n) for n in nodes[:world])
        return [n[:per] for n in nodes[:world]], per, f"one NUMA node per rank ({len(nodes)})"
    if len(cores) < world:
        return [[] for _ in range(world)], 1, f"unpinned: {len(cores)} cores for {world} ranks"
    per = len(cores) // world
    runs = [cores[r * per : (r + 1) * per] for r in range(world)]
    return runs, per, f"{per} core(s) per rank, {len(nodes) or 1} NUMA node(s)"


def launch(
    settings: RankSettings,
    processes: list[subprocess.Popen] | None = None,
    local_ranks: range | None = None,
    admit: Callable[[RankSettings], None] | None = None,
) -> tuple[TpGroup, list[subprocess.Popen]]:
    """Rank 0 (this process): serve the rendezvous, start the `local_ranks` (default: ranks
    1..world-1, each `python -m kernels.tensor_parallel RANK SETTINGS`) and form the group.
    `admit(settings)`, run in a thread of its own with the settings as final (the store's
    port), lets other machines' ranks in; it raising fails the launch. A rank that exits
    before the group forms fails the launch at once, naming it."""
    wait = datetime.timedelta(seconds=settings.join_timeout_s)
    store = dist.TCPStore(
        settings.host, 0, settings.world, True, timeout=wait, wait_for_workers=False
    )
    settings = dataclasses.replace(settings, port=store.port)
    processes = [] if processes is None else processes  # the caller's list sees each start
    here = range(1, settings.world) if local_ranks is None else local_ranks
    start_rank_processes(settings, here, processes)
    # The group forms (and other machines are admitted) in threads of their own (daemons: a
    # launch that fails leaves them waiting out their timeouts without holding up an exit).
    joined: Future = Future()
    admitted: Future = Future()

    def form() -> None:
        try:
            joined.set_result(gloo_group(store, 0, settings.world, settings.host))
        except Exception as exc:
            joined.set_exception(exc)

    def let_in() -> None:
        try:
            admitted.set_result(admit(settings) if admit else None)
        except Exception as exc:
            admitted.set_exception(exc)

    threading.Thread(target=form, name="tp-join", daemon=True).start()
    threading.Thread(target=let_in, name="tp-admit", daemon=True).start()
    while True:
        try:
            if admitted.done():
                admitted.result()  # raises what the admission raised
            pg = joined.result(timeout=0.2)
            break
        except FuturesTimeout:
            dead = exited(processes)
            if dead:
                stop_ranks(processes)
                raise TensorParallelError(
                    f"tensor-parallel rank {dead[0][0]} exited with code {dead[0][1]} "
                    "before the group formed (its error is in the engine's stderr)"
                ) from None
        except Exception:
            stop_ranks(processes)
            raise
    return TpGroup(pg, 0, settings.world, store), processes


def start_rank_processes(
    settings: RankSettings, ranks: range, processes: list[subprocess.Popen]
) -> None:
    """Start `python -m kernels.tensor_parallel RANK SETTINGS` for each of `ranks`,
    appending each to `processes` as it starts."""
    blob = json.dumps(dataclasses.asdict(settings))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, settings.threads)))
    command = [sys.executable, "-m", "kernels.tensor_parallel"]
    for rank in ranks:
        processes.append(
            subprocess.Popen(
                [*command, str(rank), blob], env=env, preexec_fn=die_with_parent(signal.SIGKILL)
            )
        )


def die_with_parent(signum: int):
    """A `preexec_fn` that has the child get `signum` when its parent dies, however it dies
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing). Ranks get SIGKILL (they ignore SIGTERM,
    the engine's drain), a router's replicas SIGTERM (their own drain)."""

    def arm() -> None:
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return arm


def exited(processes: list[subprocess.Popen]) -> list[tuple[int, int]]:
    """(rank, exit code) of each rank process that has exited (ranks count from 1)."""
    return [(r, p.returncode) for r, p in enumerate(processes, 1) if p.poll() is not None]


def stop_ranks(processes: list[subprocess.Popen]) -> None:
    """Kill and reap the ranks (they keep no state; they ignore SIGINT and SIGTERM, which
    belong to the engine's drain)."""
    for p in processes:
        if p.poll() is None:
            p.kill()
    for p in processes:
        p.wait()


def cuda_gpus(ranks: int, visible: int) -> list[int]:
    """The GPU index of each of a machine's `ranks` CUDA ranks: one GPU each, in order; a
    ValueError naming both counts when fewer are `visible`."""
    if visible < ranks:
        raise ValueError(
            f"{ranks} tensor-parallel ranks on this machine need a GPU each; torch sees "
            f"{visible} (CUDA_VISIBLE_DEVICES chooses which)"
        )
    return list(range(ranks))


def check_node(hello: dict, world: int, nnodes: int, device: str) -> None:
    """A ValueError naming why node 0 refuses another node's hello: another
    tensor_parallel_size or nnodes, or (CUDA) fewer GPUs than its share of the ranks."""
    theirs = (hello.get("world"), hello.get("nnodes"))
    node = hello.get("node_rank")
    if theirs != (world, nnodes):
        raise ValueError(
            f"node {node} has tensor_parallel_size, nnodes = {theirs}; node 0 has {(world, nnodes)}"
        )
    if device == "cuda" and "gpus" in hello:
        try:
            cuda_gpus(world // nnodes, int(hello["gpus"]))
        except ValueError as exc:
            raise ValueError(f"node {node}: {exc}") from None


def use_rank_device(settings: RankSettings, rank: int) -> None:
    """Make `rank`'s GPU the calling thread's current device (CUDA ranks; else nothing):
    its executor's "cuda" tensors, and its NCCL communicator, are then on that GPU."""
    if settings.device == "cuda":
        torch.cuda.set_device(settings.gpus[rank])


def build_rank(settings: RankSettings, group: TpGroup):
    """(whole config, this rank's executor): its shard, its share of the KV pool, its
    attention backend, the collectives wired in. Call with the rank's device current
    (`use_rank_device`)."""
    from kernels.model_executor import build_executor

    group.attach_data_group(settings.data_backend, settings.host)
    dtype = getattr(torch, settings.dtype)
    config, local, model = load_shard(settings.model, dtype, group)
    executor = build_executor(
        local,
        model,
        None,
        device=settings.device,
        dtype=dtype,
        attention=settings.attention,
        linear=agreed_linear(settings.linear, model, dtype, group, settings.device),
        num_pages=settings.num_pages,
        swa_num_pages=settings.swa_num_pages,
        page_size=settings.page_size,
        max_rows=settings.max_rows,
        row_capacity=settings.row_capacity,
    )
    parallelize(executor, group, config.vocab)
    # Every rank loaded: a rank that failed fails this (its sockets closed), so the start.
    group.control_all_reduce(torch.ones(1))
    # The data group's first collective (NCCL forms its communicator here): a bad setup
    # fails the start, not the first step.
    check = group.all_reduce(torch.ones(1, device=group.device))
    if int(check.item()) != group.world:
        raise TensorParallelError(f"the data group summed {check.item()} over {group.world}")
    return config, executor


def agreed_linear(
    requested: str, model: nn.Module, dtype: torch.dtype, group: TpGroup, device: str = "cpu"
) -> str:
    """One weight layout for every rank: "auto" settles on each rank's own share (the fp16
    layouts need its weights within fp16's range), so the ranks vote, and a layout they do
    not all pick gives way to aten."""
    from kernels.linear import LINEAR_BACKENDS, choose_linear_backend

    if requested != "auto":
        return requested
    weights = [m.weight for m in model.layers.modules() if type(m) is nn.Linear]
    weights.append(model.lm_head_weight)
    mine = choose_linear_backend(requested, torch.device(device), dtype, weights)[0]
    votes = torch.zeros(len(LINEAR_BACKENDS))
    votes[LINEAR_BACKENDS.index(mine)] = 1
    group.control_all_reduce(votes)
    return mine if int(votes[LINEAR_BACKENDS.index(mine)]) == group.world else "aten"


def worker_main(argv: list[str]) -> int:
    """A rank other than 0: join, build the shard, run rank 0's commands until it stops
    or the group breaks (then exit 1: rank 0 sees its sockets close)."""
    # A terminal's Ctrl-C or a service manager's SIGTERM to the whole group starts the
    # engine's drain; the ranks serve its last steps and go when rank 0 stops them or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank, settings = int(argv[0]), RankSettings(**json.loads(argv[1]))
    cores = settings.cores[rank]
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(max(1, settings.threads))
    use_rank_device(settings, rank)
    wait = datetime.timedelta(seconds=settings.join_timeout_s)
    group = TpGroup.join(settings.host, settings.port, rank, settings.world, wait)
    _, executor = build_rank(settings, group)
    try:
        while True:
            kind, args = group.receive()
            if kind == "stop":
                return 0
            if kind == "probe":
                probe_collectives(group, *args)
            else:
                getattr(executor, kind)(*args)  # "forward" / "forward_full"
    except Exception as exc:
        print(f"tensor-parallel rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
