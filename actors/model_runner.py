"""The model runner actor: weights, KV tensors, the req-to-token replica, forward + sampling.

One `ForwardBatchMsg` in, one `StepResultMsg` out. Loading and every forward
run on one dedicated worker thread (torch releases the GIL), so actors sharing
this process keep serving while the model computes. One thread, always the same:
each thread that calls torch gets its own OpenMP team, and an idle team spinning
next to a busy one halves (or worse) the speed of both. Sampling state lives here
per request: registered by `new_reqs` (derived from its `GenerationParams`),
dropped by `finished_rids`. A constrained request names its grammar by key: the tokenizer
actor compiled it and handed it over once (`LoadGrammar`, kept in a cache bounded in bytes);
its matcher joins the request's sampler state (`kernels.grammar`). A request that cannot be
registered (its grammar is not held) is reported in `failed_rids`, alone: the step serves
the others. Any other exception in a step is an error reply to the scheduler, which fails
that step's requests; the runner serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import msgspec
import numpy as np
import torch

from actors.runtime import Actor
from actors.runtime.gc_freeze import freeze_survivors, thaw
from kernels.compiled_step import COMPILE_MODES, CompiledStep, compile_choice
from kernels.compiled_step import cache_root as compile_cache_root
from kernels.cuda_graphs import GRAPH_BACKENDS
from kernels.grammar import ByteLRU
from kernels.host_memory import keep_freed_memory
from kernels.q8_0 import kernel_status as q8_0_kernel_status
from transport.messages.control import Ack
from transport.messages.runner import ForwardBatchMsg, GrammarLoaded, LoadGrammar, StepResultMsg
from transport.messages.tiers import (
    KvDrop,
    KvLoad,
    KvPersist,
    KvRestore,
    KvRestored,
    KvSave,
    KvSaved,
    KvSpill,
    KvSpilled,
    KvStage,
    KvStaged,
    KvStoreContents,
    KvStoreQuery,
    PersistedSession,
)

GRAMMAR_CACHE_BYTES = 256 << 20


class RegisterFailed(Exception):
    """One request of a batch cannot be registered (e.g. its grammar is not held)."""


class ModelRunnerActor(Actor):
    inbox = (
        ForwardBatchMsg
        | LoadGrammar
        | KvSave
        | KvLoad
        | KvSpill
        | KvDrop
        | KvStoreQuery
        | KvPersist
        | KvRestore
        | KvStage
    )

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_rows: int,
        row_capacity: int,
        model: str | None = None,
        dtype: str = "auto",
        attention: str = "auto",
        threads: int = 0,
        own_process: bool = False,
        quantization: str = "none",
        swa_num_pages: int = 0,
        device: str = "auto",
        cuda_graphs: bool = True,
        linear: str = "auto",
        grammar_cache_bytes: int = GRAMMAR_CACHE_BYTES,
        compile: str = "off",
        store_dir: str = "",
        tensor_parallel_size: int = 1,
        nnodes: int = 1,
        dist_init_addr: str = "",
        curve_secret_file: str = "",
        join_timeout_s: float = 120.0,
    ) -> None:
        from kernels.cpu import choose_dtype, choose_threads, one_thread_here
        from kernels.device import choose_attention, choose_device
        from kernels.linear import choose_linear_backend
        from kernels.models import PLAN_KINDS

        if quantization not in ("auto", *PLAN_KINDS):
            raise ValueError(
                f"quantization must be auto or one of {tuple(PLAN_KINDS)}, got {quantization!r}"
            )
        self.requested_quantization = quantization
        self.quantization = quantization  # settled ("auto" resolved) when the model loads
        self.model_path = model
        # Chosen here, before anything loads: what this machine cannot run fails the start.
        self.device, self.device_reason = choose_device(device)
        self.dtype, self.dtype_reason = choose_dtype(dtype, self.device)
        self.attention_name, self.attention_reason = choose_attention(
            attention, self.device, self.dtype
        )
        # What this machine cannot run fails here; "auto" is settled with the weights loaded.
        # Quantized linears are no nn.Linear left to pack: auto means aten for them.
        quantizes = quantization not in ("none", "auto")
        self.linear = "aten" if quantizes and linear == "auto" else linear
        self.linear_reason = choose_linear_backend(
            self.linear, torch.device(self.device), self.dtype
        )[1]
        if quantizes and self.device != "cpu":
            raise ValueError(f"quantization = {quantization} is a CPU path; use none on CUDA")
        self.threads, self.threads_reason = choose_threads(threads, own_process)
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        self.tp = tensor_parallel_size
        # ranks on other machines (node 0 here): admitted at dist_init_addr with CURVE
        self.nnodes, self.dist_init_addr = nnodes, dist_init_addr
        self.curve_secret_file, self.join_timeout_s = curve_secret_file, join_timeout_s
        self.tp_group = None  # kernels.tensor_parallel.TpGroup, formed in `_load`
        self._ranks: list = []  # the other ranks' processes
        self.tp_cores: list[list[int]] = []
        self.tp_gpus: list[int] = []  # CUDA: each of this machine's ranks' GPU (-1: elsewhere)
        self.tp_placement = ""
        self._stopping = False  # on_stop ran: a load still starting ranks stops them
        self._admitting = None  # transport.rendezvous.Admission while other nodes join
        if self.tp > 1:
            compile, cuda_graphs, store_dir = self._tensor_parallel_settings(quantization, threads)
        self.requested_compile = compile  # settled with the weights' layout (`_load`)
        self.num_pages = num_pages
        self.swa_num_pages = swa_num_pages  # sliding layers' own pool (0: they share the full one)
        self.page_size = page_size
        self.max_rows = max_rows
        self.row_capacity = row_capacity
        self.own_process = own_process
        # Decode graphs need CUDA and a backend that plans into fixed buffers (GRAPH_BACKENDS).
        self.cuda_graphs = (
            cuda_graphs and self.device == "cuda" and self.attention_name in GRAPH_BACKENDS
        )
        self._grammars = None  # kernels.grammar.GrammarEngine, built on first use
        self._grammars_lock = threading.Lock()
        # key -> compiled grammar, as handed over by `LoadGrammar` (least recently used
        # dropped past the bound; a request whose grammar was dropped fails alone)
        self._grammar_cache = ByteLRU(grammar_cache_bytes)
        self.executor = None
        self.sampler = None
        self.kv_store = None  # kernels.kv_store.HostKvStore: the tiers' bytes
        self.store_dir = store_dir  # the disk tier's root ("": none)
        self._adopted: list[dict] = []  # sessions a previous run persisted, until KvRestore
        self.steps = 0
        self.forward_s = 0.0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner-torch")
        # The compute threads are the worker's alone (it sets its count in `_load`); the
        # thread building this actor, the event loop's, computes with one.
        one_thread_here()

    def _tensor_parallel_settings(self, quantization: str, threads: int) -> tuple[str, bool, str]:
        """Check and settle what a tensor-parallel runner runs: CPU ranks on gloo, or CUDA
        ranks (one GPU each) with their step's collectives on NCCL; exact weights, eager
        steps, no KV tiers; each rank pinned to its share of the cores. Returns (compile,
        cuda_graphs, store_dir) as it runs them."""
        from kernels.tensor_parallel import core_placement, cuda_gpus

        if self.tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tp}")
        here = self.tp // self.nnodes  # this machine's ranks: 0 .. here - 1
        if self.device == "cuda":
            self.tp_gpus = cuda_gpus(here, torch.cuda.device_count())
            self.tp_gpus += [-1] * (self.tp - here)  # other machines choose their own
        if quantization not in ("auto", "none"):
            raise ValueError(
                f"tensor parallelism splits exact weights; quantization = {quantization} "
                "is a one-rank mode (use none or auto)"
            )
        self.requested_quantization = "none"
        cores, per_rank, how = core_placement(here, sorted(os.sched_getaffinity(0)))
        self.tp_cores = cores + [[] for _ in range(self.tp - here)]  # others place their own
        self.tp_placement = how
        if threads <= 0:
            self.threads = per_rank
            self.threads_reason = f"auto: {per_rank} per rank ({how})"
        return "off", False, ""

    async def _on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def on_start(self) -> None:
        self._stage_reads = anyio.Lock()  # disk read-aheads, one at a time
        self._spill_writes = anyio.Lock()  # disk-tier files written, one at a time
        self.log.info(
            "runner settings",
            device=self.device,
            device_reason=self.device_reason,
            attention=self.attention_name,
            attention_reason=self.attention_reason,
            linear=self.linear,
            cuda_graphs=self.cuda_graphs,
            dtype=str(self.dtype).removeprefix("torch."),
            dtype_reason=self.dtype_reason,
            threads=self.threads,
            threads_reason=self.threads_reason,
            host_memory=keep_freed_memory()[1],
            tensor_parallel_size=self.tp,
            rank_cores=self.tp_cores or None,
            rank_placement=self.tp_placement or None,
        )
        await self._on_worker(self._load)
        if self.tp > 1:
            self.every(1.0, self._watch_ranks)

    async def _watch_ranks(self) -> None:
        """Crash this actor (its supervisor then applies `engine.runner_on_crash`) once a
        rank has died or a collective failed: the group cannot serve another step."""
        from kernels.tensor_parallel import TensorParallelError, exited

        dead = exited(self._ranks)
        if dead:
            why = f"tensor-parallel rank {dead[0][0]} exited with code {dead[0][1]}"
            if self.tp_group is not None:  # a step waiting on the dead rank's GPU ends now
                await anyio.to_thread.run_sync(self.tp_group.abort, why)
            raise TensorParallelError(why)
        if self.tp_group is not None and self.tp_group.broken:
            raise TensorParallelError(self.tp_group.broken)

    async def on_stop(self) -> None:
        self._stopping = True
        if self._admitting is not None:
            self._admitting.cancel()
        self._say_stop_to_ranks()  # on the worker thread, so before it goes
        self._worker.shutdown(wait=False, cancel_futures=True)
        # The weights and the KV pool go now, not at the next full garbage collection (which
        # large tensors never trigger): the actor and its cell reference each other, and so
        # does the LM head with its chosen kernels, so without this a stopped runner's
        # gigabytes stay (a restarted runner loads beside them; engines made one after
        # another in a process pile up).
        if self.executor is not None:
            # a compile still running holds its CompiledStep alone: without the executor's
            # reference back, both go by reference counting when it ends, not by a
            # collection (which another runner's freeze could put off until its own stop)
            self.executor.compiled = None
        self.executor = None
        self.sampler = None
        if self._ranks:
            from kernels.tensor_parallel import stop_ranks

            stop_ranks(self._ranks)
            self._ranks = []
        if self.tp_group is not None:  # NCCL: its communicator goes now, not at a collection
            await anyio.to_thread.run_sync(self.tp_group.abort, "the runner stopped")
        self.tp_group = None
        if self.kv_store is not None:
            self.kv_store.close()  # the disk tier's files die with this runner
        self.kv_store = None
        thaw()  # frozen cycles (this runner's among them) are collectable again
        gc.collect()

    def _load(self) -> None:
        from kernels.kv_store import HostKvStore
        from kernels.memory_plan import measured_weight_bytes
        from kernels.model_executor import build_executor
        from kernels.models import load_for
        from kernels.sampling import Sampler

        torch.set_num_threads(self.threads)
        if self.tp > 1:
            self._load_ranks()
        else:
            config, model, lm_head, self.quantization, why = load_for(
                self.model_path, self.dtype, self.requested_quantization, self.device
            )
            self.log.info("quantization", quantization=self.quantization, reason=why)
            if lm_head is not None and self.linear == "auto":
                self.linear = "aten"  # quantized linears are no nn.Linear left to pack
            self.config = config
            self.executor = build_executor(
                config,
                model,
                lm_head,
                device=self.device,
                dtype=self.dtype,
                attention=self.attention_name,
                linear=self.linear,
                cuda_graphs=self.cuda_graphs,
                **self._pool_shape(),
            )
        kv = self.executor.kv_cache
        self.kv_store = HostKvStore(kv, *self._disk_tier(self.config))
        self._adopted = self.kv_store.adopt_manifest()  # a previous run's sessions (KvRestore)
        model = self.executor.model
        self.linear, self.linear_reason = self.executor.linear, self.executor.linear_reason
        compiles, why = compile_choice(self.requested_compile, self.device, self.dtype, self.linear)
        if self.tp > 1:
            why = "off: a tensor-parallel step runs eagerly (its collectives are in no graph)"
        self.log.info("compile", compile=compiles, reason=why, cache=str(compile_cache_root()))
        frozen = freeze_survivors(lambda: not self._stopping)
        if frozen is not None:
            self.log.info("gc frozen", after="weights", **frozen)
        if compiles:
            self.executor.compiled = CompiledStep(self.executor)
            threading.Thread(target=self._compile, name="compile-step", daemon=True).start()
        self.log.info(
            "weights",
            linear=self.linear,
            linear_reason=self.linear_reason,
            lm_head_plan=self.executor.lm_head.plan,
            q8_0_kernel=q8_0_kernel_status(),
            head_blocks_error=self.executor.head_blocks_error,
            linear_blocks=self.executor.linear_blocks,
            linear_blocks_error=self.executor.linear_blocks_error,
            linear_operator=self.executor.linear_operator,
            weights_bytes=measured_weight_bytes(model, self.executor.lm_head),
        )
        self.sampler = Sampler()
        if self.own_process:
            from kernels.grammar import grammar_available

            # Alone in its process, nothing shares its tokenizer preparation: do it now, in
            # the background, rather than in the first constrained request's step.
            if grammar_available():
                threading.Thread(target=self._grammar_engine, daemon=True).start()

    def _say_stop_to_ranks(self) -> None:
        """Tell every rank (other machines' too) the group is over, on the compute thread
        (the group's only user) and within a second; a rank not told notices the group's
        sockets closing."""
        group = self.tp_group
        if group is None or group.broken:
            return
        with contextlib.suppress(Exception):
            self._worker.submit(group.send, ("stop", ())).result(timeout=1.0)

    def _pool_shape(self) -> dict:
        return dict(
            num_pages=self.num_pages,
            swa_num_pages=self.swa_num_pages,
            page_size=self.page_size,
            max_rows=self.max_rows,
            row_capacity=self.row_capacity,
        )

    def _load_ranks(self) -> None:
        """Start the other ranks and build this one's share (kernels/tensor_parallel)."""
        from kernels.models import load_config
        from kernels.tensor_parallel import (
            ParallelExecutor,
            RankSettings,
            build_rank,
            check_split,
            launch,
            stop_ranks,
            use_rank_device,
        )

        check_split(load_config(self.model_path), self.tp)  # before any rank starts
        settings = RankSettings(
            model=self.model_path,
            dtype=str(self.dtype).removeprefix("torch."),
            attention=self.attention_name,
            linear=self.linear,
            threads=self.threads,
            world=self.tp,
            cores=self.tp_cores,
            join_timeout_s=self.join_timeout_s,
            device=self.device,
            gpus=self.tp_gpus,
            data_backend="nccl" if self.device == "cuda" else "",
            **self._pool_shape(),
        )
        use_rank_device(settings, 0)  # this thread computes rank 0's share
        if self.tp_cores[0]:
            os.sched_setaffinity(0, self.tp_cores[0])  # this thread: rank 0's compute
        # `self._ranks` sees each rank as it starts, so a stop during the load finds them
        admit = None
        if self.nnodes > 1:
            admit, settings.host = self._admission()
        here = range(1, self.tp // self.nnodes)
        try:
            self.tp_group, _ = launch(settings, self._ranks, local_ranks=here, admit=admit)
        except BaseException:
            if self._admitting is not None:
                self._admitting.cancel()  # its thread gives up and closes it, or:
                self._admitting.close_unless_admitting()
            raise
        if self._stopping:  # the actor stopped while the ranks started
            stop_ranks(self._ranks)
            raise RuntimeError("the runner stopped while its ranks started")
        self.quantization = "none"
        why = "tensor parallelism splits exact weights"
        self.log.info("quantization", quantization="none", reason=why)
        self.config, local = build_rank(settings, self.tp_group)
        self.executor = ParallelExecutor(local, self.tp_group)
        self.log.info(
            "tensor parallel group formed",
            ranks=self.tp,
            pids=[p.pid for p in self._ranks],
            heads_per_rank=local.config.num_heads,
            kv_heads_per_rank=local.config.num_kv_heads,
            device=self.device,
            gpus=self.tp_gpus or None,
            data_group=self.tp_group.data_backend,
        )

    def _admission(self):
        """(admit, rendezvous host) for ranks on other machines: node 0 listens at
        dist_init_addr now (an address not this machine's fails the start, naming it) and
        `admit(settings)` answers each other node with them, until all have joined."""
        import dataclasses

        from kernels.tensor_parallel import check_node
        from transport.rendezvous import Admission, split_address
        from transport.security import read_curve_secret

        admission = Admission(self.dist_init_addr, read_curve_secret(self.curve_secret_file))
        self._admitting = admission  # a failed launch or a stop cancels it

        def answer(hello: dict) -> dict:
            check_node(hello, self.tp, self.nnodes, self.device)
            return {"settings": dataclasses.asdict(settings_now[0])}

        settings_now: list = []

        def admit(settings) -> None:
            settings_now.append(settings)
            admission.started = True
            try:
                deadline = time.monotonic() + self.join_timeout_s
                admission.admit(set(range(1, self.nnodes)), answer, deadline)
            finally:
                admission.close()

        return admit, split_address(self.dist_init_addr)[0]

    def _disk_tier(self, config) -> tuple[Path | None, str]:
        """The disk tier's folder (`store_dir/<fingerprint>`: one engine per store_dir) and
        the fingerprint its files carry: the model file and the KV layout."""
        model = Path(self.model_path or "embedded").expanduser()
        stat = model.stat() if model.exists() else None
        ident = (
            f"{model.resolve() if stat else model}|{stat.st_size if stat else 0}|"
            f"{stat.st_mtime_ns if stat else 0}|{self.dtype}|{config.num_layers}|"
            f"{config.num_kv_heads}|{config.head_dim}|{sorted(config.sliding_layers)}|"
            f"{self.page_size}|{self.swa_num_pages > 0}"
        )
        fingerprint = hashlib.sha256(ident.encode()).hexdigest()[:16]
        if not self.store_dir:
            return None, fingerprint
        return Path(self.store_dir).expanduser() / fingerprint, fingerprint

    def _compile(self) -> None:
        """Background: compile the small-step graph; steps switch to it once ready."""
        compiled = self.executor.compiled
        compiled.compile()
        if self._stopping:
            return  # the runner stopped meanwhile: nothing to switch to or to freeze
        if compiled.ready:
            self.log.info(
                "compiled steps ready",
                compile_s=round(compiled.compile_s, 1),
                max_tokens=compiled.max_tokens,
                dynamo_bypassed=compiled.direct_ready,
                dynamo_bypass_error=compiled.direct_failed,
            )
            frozen = freeze_survivors(lambda: not self._stopping)
            if frozen is not None:
                self.log.info("gc frozen", after="compiled steps", **frozen)
        else:
            self.log.warning("compile failed; steps stay eager", error=compiled.failed)

    def _grammar_engine(self):
        with self._grammars_lock:
            if self._grammars is None:
                from kernels.grammar import GrammarEngine
                from kernels.tokenizer_loader import load_tokenizer

                bundle = load_tokenizer(self.model_path)
                self._grammars = GrammarEngine.shared(
                    str(bundle.extra.get("source", self.model_path)),
                    bundle.tokenizer,
                    bundle.vocab_size,
                    bundle.eos_ids,
                )
            return self._grammars

    def _matcher(self, new):
        """The grammar matcher of a constrained request (None for a free one)."""
        c = new.params.constraint
        if c is None:
            return None
        if new.grammar_key:
            compiled = self._grammar_cache.get(new.grammar_key)
            if compiled is None:
                raise RegisterFailed(
                    f"its compiled grammar {new.grammar_key} is not loaded in the runner"
                )
            return self._grammar_engine().matcher(compiled)
        # not compiled upstream (a test driving the runner directly): compile here
        engine = self._grammar_engine()
        return engine.matcher(engine.compile(c.kind, c.spec, c.choices))

    async def handle(self, msg, sender):
        if isinstance(msg, LoadGrammar):
            return await self._load_grammar(msg)
        if isinstance(msg, ForwardBatchMsg):
            try:
                result = await self._on_worker(self._step, msg)
                if self.tp_group is not None:
                    self.tp_group.check()  # a collective that failed unseen fails the step
                return result
            finally:
                if self.tp_group is not None and self.tp_group.broken:
                    self.spawn(self._watch_ranks)  # crashes this actor now, not at the next tick
        if isinstance(msg, KvStage):
            return self.reply_later(self._stage, msg.handle)
        if isinstance(msg, KvSpill):
            return self.reply_later(self._spill, msg.handle)
        # Tier moves run on the worker too, so they never overlap a step's forward.
        return await self._on_worker(self._tier_move, msg)

    async def _stage(self, handle: int) -> KvStaged:
        """Read a spilled entry beside the steps (a thread of its own: file reading and the
        checksum), then hand the copy to the store on the worker, between steps."""
        store = self.kv_store
        if store is None:
            return KvStaged(handle=handle, staged=False)
        async with self._stage_reads:  # one file at a time: at most one copy in flight
            read = await anyio.to_thread.run_sync(store.read_spilled, handle)
            staged = read is not None and await self._on_worker(store.put_staged, handle, read)
        return KvStaged(handle=handle, staged=staged)

    async def _spill(self, handle: int) -> KvSpilled:
        """Write a host entry's file beside the steps (a thread of its own), then make it
        the entry on the worker, between steps. A spill of a handle whose write is under
        way waits for that write and answers its file."""
        store = self.kv_store
        async with self._spill_writes:
            entry = await self._on_worker(store.spill_source, handle)
            if entry is None:
                return KvSpilled(handle=handle, nbytes=store.on_disk[handle])
            partial = await anyio.to_thread.run_sync(store.write_partial, handle, entry)
            nbytes = await self._on_worker(store.commit_spill, handle, entry, partial)
        return KvSpilled(handle=handle, nbytes=nbytes)

    def _tier_move(self, msg):
        store = self.kv_store
        if isinstance(msg, KvSave):
            nbytes = store.save(msg.handle, np.asarray(msg.full_slots), np.asarray(msg.swa_slots))
            return KvSaved(handle=msg.handle, nbytes=nbytes)
        if isinstance(msg, KvLoad):
            store.load(
                msg.handle,
                msg.start,
                np.asarray(msg.full_slots),
                np.asarray(msg.swa_index),
                np.asarray(msg.swa_slots),
            )
            return Ack()
        if isinstance(msg, KvPersist):
            store.write_manifest([msgspec.to_builtins(s) for s in msg.sessions])
            return Ack()
        if isinstance(msg, KvRestore):
            found = []
            for raw in self._adopted:
                try:
                    found.append(msgspec.convert(raw, PersistedSession))
                except msgspec.ValidationError:
                    pass  # its file goes with the unclaimed ones
            self._adopted = []
            store.claim([s.handle for s in found])
            return KvRestored(sessions=found)
        if isinstance(msg, KvDrop):
            store.drop(list(msg.handles))
            return Ack()
        sizes = store.sizes()
        return KvStoreContents(
            handles=list(sizes),
            nbytes=[n for _, n in sizes.values()],
            tiers=[t for t, _ in sizes.values()],
        )

    async def _load_grammar(self, msg: LoadGrammar):
        """Keep a compiled grammar by key. A query (no data) is answered at once; a load is
        deserialized off the mailbox (`reply_later`), so forward steps are not held up."""
        if self._grammar_cache.get(msg.key) is not None:
            return GrammarLoaded(key=msg.key, present=True)
        if not msg.data:
            return GrammarLoaded(key=msg.key, present=False)

        async def load() -> GrammarLoaded:
            from kernels.grammar import grammar_nbytes

            engine = await anyio.to_thread.run_sync(self._grammar_engine)
            compiled = await anyio.to_thread.run_sync(engine.deserialize, msg.data)
            kept = self._grammar_cache.put(msg.key, compiled, grammar_nbytes(compiled))
            return GrammarLoaded(key=msg.key, present=kept)

        return self.reply_later(load)

    def _step(self, msg: ForwardBatchMsg) -> StepResultMsg:
        from kernels.forward_batch import ForwardBatch, SlotDeltas

        t0 = time.perf_counter()
        sampler = self.sampler
        for rid in msg.finished_rids:
            sampler.remove_request(rid)
        failed: list[int] = []
        failure = ""
        for new in msg.new_reqs:
            try:
                matcher = self._matcher(new)
            except RegisterFailed as exc:
                # This request alone fails: its KV is still written (its own slots), but
                # nothing is sampled for it, and the scheduler ends it with an error.
                failed.append(new.rid)
                failure = str(exc)
                continue
            sampler.add_request(new.rid, new.params, list(new.prompt_ids), matcher)
        if not msg.rids:
            return StepResultMsg(
                step=msg.step, rids=[], tokens=[], failed_rids=failed, failure=failure
            )
        ends = np.cumsum(msg.extend_lens)
        flat = msg.input_ids
        inputs = [flat[e - n : e] for e, n in zip(ends.tolist(), msg.extend_lens)]
        d = msg.deltas
        batch = ForwardBatch(
            rows=list(msg.rows),
            prefix_lens=list(msg.prefix_lens),
            input_ids=inputs,
            need_logits=list(msg.need_logits),
            slot_deltas=SlotDeltas(
                d.rows, d.starts, d.lengths, d.slots, d.swa_full_pages, d.swa_pages
            ),
        )
        prompt = _PromptLogprobs()
        wants_prompt = [k >= 0 for k in msg.prompt_logprobs] or [False] * len(msg.rids)
        drafts = msg.draft_lens or [0] * len(msg.rids)
        full = [w or k > 0 for w, k in zip(wants_prompt, drafts)]
        spans: dict[int, torch.Tensor] = {}  # request index -> logits of all its new tokens
        if any(full):
            logits, per_request = self.executor.forward_full(batch, full)
            spans = dict(zip([i for i, f in enumerate(full) if f], per_request))
            if any(wants_prompt):  # raw logits: before any penalty
                prompt.compute(msg, inputs, [spans[i] for i, w in enumerate(wants_prompt) if w])
        else:
            logits = self.executor.forward(batch)
        # Row j of `logits` is request need[j]'s last new token. Plain rows are sampled in one
        # batch; a request with drafts has them verified against all its rows, alone.
        need = [i for i, n in enumerate(msg.need_logits) if n]
        dead = set(failed)  # their rows of the logits are left unused
        plain = [j for j, i in enumerate(need) if msg.rids[i] not in dead and not drafts[i]]
        emitted: dict = {}  # request index -> its kernels.sampling.SampleOutput
        if plain:
            rows = logits if len(plain) == logits.shape[0] else logits[plain]
            out = sampler.sample([msg.rids[need[j]] for j in plain], rows)
            for k, j in enumerate(plain):
                emitted[need[j]] = _row(out, k)
        for i in need:
            if drafts[i] and msg.rids[i] not in dead:
                draft = inputs[i][1:]
                emitted[i] = sampler.verify(msg.rids[i], spans[i], list(draft))
        elapsed = time.perf_counter() - t0
        self.steps += 1
        self.forward_s += elapsed
        result = _Emitted.collect(msg, emitted)
        return StepResultMsg(
            step=msg.step,
            forward_ms=elapsed * 1e3,
            failed_rids=failed,
            failure=failure,
            **result,
            **prompt.fields(),
        )

    def stats(self) -> dict[str, int | float]:
        compiled = self.executor.compiled if self.executor is not None else None
        return {
            "runner_steps": self.steps,
            "runner_forward_s": round(self.forward_s, 3),
            "runner_compiled_ready": int(compiled is not None and compiled.ready),
            "runner_compiled_steps": 0 if compiled is None else compiled.steps,
            "runner_compiled_direct_steps": 0 if compiled is None else compiled.direct_steps,
            "runner_compile_fallbacks": 0 if compiled is None else compiled.fallbacks,
        }


def _row(out, k: int):
    """Row k of a batched `SampleOutput`, as a one-token `SampleOutput`."""
    from kernels.sampling import SampleOutput

    return SampleOutput(
        tokens=[out.tokens[k]],
        logprobs=None if out.logprobs is None else [out.logprobs[k]],
        top_logprobs=None if out.top_logprobs is None else [out.top_logprobs[k]],
    )


class _Emitted:
    """The step's tokens per request, flat, in batch order (`StepResultMsg` fields)."""

    @staticmethod
    def collect(msg: ForwardBatchMsg, emitted: dict) -> dict:
        rids, counts, tokens = [], [], []
        logprobs: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        any_lp = any(o.logprobs is not None for o in emitted.values())
        any_top = any(o.top_logprobs is not None for o in emitted.values())
        for i in sorted(emitted):
            out = emitted[i]
            rids.append(msg.rids[i])
            counts.append(len(out.tokens))
            tokens += [int(t) for t in out.tokens]
            if any_lp:
                lps = out.logprobs or [None] * len(out.tokens)
                logprobs += [0.0 if lp is None else float(lp) for lp in lps]
            if any_top:
                tops = out.top_logprobs or [[] for _ in out.tokens]
                top_ids += [[t for t, _ in row] for row in tops]
                top_lps += [[float(lp) for _, lp in row] for row in tops]
        fields = {
            "rids": rids,
            "tokens": tokens,
            "logprobs": logprobs,
            "top_ids": top_ids,
            "top_logprobs": top_lps,
        }
        if any(c != 1 for c in counts):
            fields["counts"] = counts
        return fields


class _PromptLogprobs:
    """Prompt logprobs of one step: for each request that asked, the logprob of every new
    token's successor (the chunk's next tokens, then the first token of the next chunk)."""

    def __init__(self) -> None:
        self.rids: list[int] = []
        self.counts: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []

    def compute(self, msg: ForwardBatchMsg, inputs: list, per_request: list) -> None:
        from kernels.logprobs import token_logprobs

        rows = iter(per_request)
        for i, k in enumerate(msg.prompt_logprobs):
            if k < 0:
                continue
            targets = list(inputs[i][1:])
            if msg.next_ids[i] >= 0:
                targets.append(msg.next_ids[i])
            lps, ranks, ids, tops = token_logprobs(next(rows), targets, k)
            self.rids.append(msg.rids[i])
            self.counts.append(len(lps))
            self.logprobs += lps
            self.ranks += ranks
            self.top_ids += ids
            self.top_logprobs += tops

    def fields(self) -> dict:
        if not self.rids:
            return {}
        return {
            "prompt_rids": self.rids,
            "prompt_counts": self.counts,
            "prompt_token_logprobs": self.logprobs,
            "prompt_ranks": self.ranks,
            "prompt_top_ids": self.top_ids,
            "prompt_top_logprobs": self.top_logprobs,
        }
