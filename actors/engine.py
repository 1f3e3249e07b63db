"""Engine assembly: config -> actor specs -> a running `ServingEngine`.

`EngineConfig` mirrors configs/default.toml. `ServingEngine` starts the radix,
allocator, runner, scheduler and tokenizer actors plus an in-process frontend
(placement by config), and exposes an `EngineClient`, KV / scheduler stats and
health. `generate_offline` is the batch API: prompts in, results out.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from actors.frontend import EngineClient, FrontendActor, GenerationResult, StreamRouter
from actors.supervisor import ActorSpec, Engine
from transport.messages.alloc import KvStats, KvStatsRequest
from transport.messages.engine import GenerationParams, SchedulerStats, SchedulerStatsRequest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "default.toml"


@dataclass
class ModelSection:
    path: str = ""
    dtype: str = "bfloat16"
    attention: str = "torch"
    threads: int = 1


@dataclass
class KvSection:
    page_size: int = 16
    num_pages: int = 1024
    max_rows: int = 80
    context_len: int = 4096
    radix: bool = True


@dataclass
class SchedulerSection:
    max_running_requests: int = 64
    max_batch_tokens: int = 1024
    chunk_size: int = 512
    policy: str = "fcfs"
    new_token_ratio: float = 0.7  # share of max_tokens reserved at admission, decaying to
    min_new_token_ratio: float = 0.1  # this floor while no retraction happens


@dataclass
class EngineSection:
    transport: str = "inproc"
    debug_checks: bool = False
    groups: dict[str, str] = field(default_factory=dict)


@dataclass
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""
    model_name: str = "gemma-3-270m"


@dataclass
class EngineConfig:
    model: ModelSection = field(default_factory=ModelSection)
    kv: KvSection = field(default_factory=KvSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    engine: EngineSection = field(default_factory=EngineSection)
    server: ServerSection = field(default_factory=ServerSection)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> EngineConfig:
        """Read a TOML config; `overrides` are "section.key" = value (e.g. kv__num_pages=64)."""
        data = tomllib.loads(Path(path or DEFAULT_CONFIG).read_text())
        cfg = cls()
        for section, values in data.items():
            target = getattr(cfg, section, None)
            if target is None or not dataclasses.is_dataclass(target):
                raise ValueError(f"unknown config section [{section}]")
            _set_fields(target, section, values)
        for key, value in overrides.items():
            section, _, name = key.partition("__")
            _set_fields(getattr(cfg, section), section, {name: value})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        k, s = self.kv, self.scheduler
        if k.max_rows < s.max_running_requests:
            raise ValueError("kv.max_rows must be >= scheduler.max_running_requests")
        if k.page_size < 1 or k.num_pages < 1 or k.context_len < 2:
            raise ValueError("kv.page_size, kv.num_pages must be >= 1, kv.context_len >= 2")
        if s.chunk_size < 1 or s.max_batch_tokens <= s.max_running_requests:
            raise ValueError("scheduler.max_batch_tokens must exceed max_running_requests")
        if self.engine.transport not in ("inproc", "ipc", "tcp"):
            raise ValueError("engine.transport must be inproc, ipc or tcp")


def _set_fields(target: Any, section: str, values: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(target)}
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"unknown config key {section}.{name}")
        setattr(target, name, value)


def build_specs(cfg: EngineConfig, frontend: FrontendActor) -> list[ActorSpec]:
    kv, sch, mdl = cfg.kv, cfg.scheduler, cfg.model
    group = cfg.engine.groups.get
    model_path = mdl.path or None
    specs = [
        ActorSpec(
            "runner",
            "actors.model_runner:ModelRunnerActor",
            dict(
                num_pages=kv.num_pages,
                page_size=kv.page_size,
                max_rows=kv.max_rows,
                row_capacity=kv.context_len,
                model=model_path,
                dtype=mdl.dtype,
                attention=mdl.attention,
                threads=mdl.threads or None,
            ),
            group=group("runner", "main"),
        ),
        ActorSpec(
            "allocator",
            "actors.allocator.actor:AllocatorActor",
            dict(
                num_pages=kv.num_pages,
                page_size=kv.page_size,
                max_rows=kv.max_rows,
                row_capacity=kv.context_len,
                radix="radix" if kv.radix else None,
                debug_checks=cfg.engine.debug_checks,
            ),
            group=group("allocator", "main"),
        ),
        ActorSpec(
            "scheduler",
            "actors.scheduler:SchedulerActor",
            dict(
                page_size=kv.page_size,
                row_capacity=kv.context_len,
                max_running_requests=sch.max_running_requests,
                max_batch_tokens=sch.max_batch_tokens,
                chunk_size=sch.chunk_size,
                policy=sch.policy,
                radix=kv.radix,
                new_token_ratio=sch.new_token_ratio,
                min_new_token_ratio=sch.min_new_token_ratio,
            ),
            group=group("scheduler", "main"),
        ),
        ActorSpec(
            "tokenizer",
            "actors.tokenizer:TokenizerActor",
            dict(context_len=kv.context_len, model=model_path),
            group=group("tokenizer", "main"),
        ),
        ActorSpec("frontend", lambda: frontend, group="main"),
    ]
    if kv.radix:
        specs.insert(
            1,
            ActorSpec(
                "radix",
                "actors.radix_cache:RadixCacheActor",
                dict(page_size=kv.page_size),
                group=group("radix", "main"),
            ),
        )
    return specs


class ServingEngine:
    """`async with ServingEngine(cfg) as eng:` -> every actor running; `eng.client` serves."""

    def __init__(self, cfg: EngineConfig | None = None, extra_specs: list[ActorSpec] = ()) -> None:
        self.cfg = cfg or EngineConfig.load()
        self.router = StreamRouter()
        self.frontend = FrontendActor(self.router)
        specs = build_specs(self.cfg, self.frontend) + list(extra_specs)
        self.engine = Engine(
            specs,
            transport=self.cfg.engine.transport,
            local_groups={"main"},
            start_timeout_s=600.0,
            call_timeout_s=600.0,
        )
        self.client: EngineClient | None = None

    async def __aenter__(self) -> ServingEngine:
        await self.engine.__aenter__()
        self.client = EngineClient(self.engine.ref("tokenizer"), self.router, "frontend")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.engine.__aexit__(*exc)

    async def kv_stats(self, check_invariants: bool = False) -> KvStats:
        return await self.engine.ref("allocator").call(
            KvStatsRequest(check_invariants=check_invariants), expect=KvStats
        )

    async def scheduler_stats(self) -> SchedulerStats:
        return await self.engine.ref("scheduler").call(
            SchedulerStatsRequest(), expect=SchedulerStats
        )

    async def generate_batch(
        self,
        prompts: list[str] | list[list[int]],
        params: GenerationParams | list[GenerationParams],
    ) -> list[GenerationResult]:
        """Submit every prompt at once; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: list[GenerationResult | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            p = prompts[i]
            kw = {"prompt": p} if isinstance(p, str) else {"prompt_ids": list(p)}
            results[i] = await self.client.complete(plist[i], **kw)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return results


def generate_offline(
    prompts: list[str] | list[list[int]],
    params: GenerationParams | list[GenerationParams] | None = None,
    config: EngineConfig | None = None,
) -> list[GenerationResult]:
    """Blocking batch generation: start an engine, run every prompt, stop the engine."""

    async def main() -> list[GenerationResult]:
        async with ServingEngine(config) as eng:
            return await eng.generate_batch(prompts, params or GenerationParams())

    return anyio.run(main)


def serving_specs(cfg: EngineConfig, zmq_address: str | None = None) -> list[ActorSpec]:
    """The client-facing actors of `bin/engine serve`: the HTTP gateway (+ ZeroMQ endpoint)."""
    actors = ["tokenizer", "scheduler", "allocator", "runner"] + (["radix"] if cfg.kv.radix else [])
    srv = cfg.server
    specs = [
        ActorSpec(
            "gateway",
            "actors.gateway.actor:GatewayActor",
            dict(
                host=srv.host,
                port=srv.port,
                api_key=srv.api_key or None,
                model_name=srv.model_name,
                context_len=cfg.kv.context_len,
                watched_actors=actors,
            ),
            group="main",
        )
    ]
    if zmq_address:
        specs.append(
            ActorSpec(
                "zmq_endpoint",
                "actors.zmq_endpoint:ZmqEndpointActor",
                dict(address=zmq_address),
                group="main",
            )
        )
    return specs
