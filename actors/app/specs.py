"""Placement: which actors a serving engine runs, built from the config, in which group.

`engine_specs` are the core actors (radix, allocator, runner, scheduler, tokenizer) plus the
in-process frontend; `serving_specs` add the client-facing ones of `bin/engine serve` (the
HTTP gateway and, when asked, the ZeroMQ endpoint). With `engine.transport = "ipc"` or
`"tcp"`, `engine.groups` maps an actor to a process group; "main" is this process.
"""

from __future__ import annotations

from actors.app.config import EngineConfig
from actors.app.model_info import generation_defaults, read_chat_template, served_names
from actors.frontends.base import FrontendActor
from actors.runtime import ActorSpec

CORE_ACTORS = ("tokenizer", "scheduler", "allocator", "runner")  # + "radix" when enabled


def core_actor_names(cfg: EngineConfig) -> list[str]:
    return [*CORE_ACTORS, *(("radix",) if cfg.kv.radix else ())]


def runner_has_own_process(cfg: EngineConfig) -> bool:
    """True when the runner's group is a child process that holds no other actor."""
    if cfg.engine.transport == "inproc":
        return False
    group = cfg.engine.groups.get("runner", "main")
    others = [a for a in (*core_actor_names(cfg), "frontend") if a != "runner"]
    return group != "main" and all(cfg.engine.groups.get(a, "main") != group for a in others)


def engine_specs(cfg: EngineConfig, frontend: FrontendActor) -> list[ActorSpec]:
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
                threads=mdl.threads,
                own_process=runner_has_own_process(cfg),
                quantization=mdl.quantization,
            ),
            group=group("runner", "main"),
            on_crash=cfg.engine.runner_on_crash,
            # The scheduler ends the requests whose step the crash lost (error to clients).
            crash_watchers=("scheduler",),
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
            "actors.scheduler.actor:SchedulerActor",
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
            "actors.tokenizer.actor:TokenizerActor",
            dict(
                context_len=kv.context_len,
                model=model_path,
                chat_template=read_chat_template(cfg),
                max_in_flight=sch.max_running_requests + sch.max_waiting_requests,
            ),
            group=group("tokenizer", "main"),
        ),
        # The in-process frontend is shared with its owner (ServingEngine), so it stays here.
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


def serving_specs(cfg: EngineConfig, zmq_address: str | None = None) -> list[ActorSpec]:
    """The client-facing actors of `bin/engine serve`: the HTTP gateway (+ ZeroMQ endpoint)."""
    srv = cfg.server
    specs = [
        ActorSpec(
            "gateway",
            "actors.frontends.http.actor:GatewayActor",
            dict(
                host=srv.host,
                port=srv.port,
                api_key=srv.api_key or None,
                model_names=served_names(cfg),
                context_len=cfg.kv.context_len,
                generation_defaults=generation_defaults(cfg),
                allowed_origins=srv.allowed_origins,
                sse_keepalive_s=srv.sse_keepalive_s,
                stuck_after_s=srv.stuck_after_s,
                header_timeout_s=srv.header_timeout_s,
                body_timeout_s=srv.body_timeout_s,
                keepalive_timeout_s=srv.keepalive_timeout_s,
                max_connections=srv.max_connections,
                watched_actors=core_actor_names(cfg),
            ),
            group="main",
        )
    ]
    if zmq_address:
        specs.append(
            ActorSpec(
                "zmq_endpoint",
                "actors.frontends.zmq_endpoint:ZmqEndpointActor",
                dict(
                    address=zmq_address,
                    api_key=srv.api_key or None,
                    curve_secret_file=srv.zmq_curve_secret_file or None,
                ),
                group="main",
            )
        )
    return specs
