"""Placement: which actors a serving engine runs, built from the config, in which group.

`engine_specs` are the core actors (radix, allocator, runner, scheduler, tokenizer, sessions)
plus the in-process frontend; `serving_specs` add the client-facing ones of `bin/engine
serve` (the HTTP gateway and, when asked, the ZeroMQ endpoint). With `engine.transport = "ipc"` or
`"tcp"`, `engine.groups` maps an actor to a process group; "main" is this process.

The KV pool's size comes from the memory plan (`memory_plan`, `kernels.memory_plan`): the
configured `kv.num_pages`, or what `kv.memory_fraction` / `kv.memory_bytes` leave room for;
the allocator, the runner, the sessions' cap and the gateway's metrics all get its figures, and
a model that cannot fit is refused here, before any actor starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from actors.app.config import ConfigError, EngineConfig
from actors.app.model_info import generation_defaults, read_chat_template, served_names
from actors.frontends.base import FrontendActor
from actors.runtime import ActorSpec
from actors.runtime.logging import get_logger
from actors.tool_calls import resolve_tool_format

if TYPE_CHECKING:
    from kernels.memory_plan import MemoryPlan

_log = get_logger("specs")

CORE_ACTORS = ("tokenizer", "scheduler", "allocator", "runner", "sessions")  # + "radix"


def host_tier_bytes(cfg: EngineConfig) -> int:
    """The host tier's budget as served: none under tensor parallelism, where each rank's
    pool holds a share of every page (the tiers copy one pool)."""
    return 0 if cfg.parallel.tensor_parallel_size > 1 else cfg.kv.host_tier_bytes


def multi_node(cfg: EngineConfig) -> dict:
    """The runner's settings for ranks on other machines (none on one machine)."""
    par = cfg.parallel
    if par.nnodes == 1:
        return {}
    return dict(
        nnodes=par.nnodes,
        dist_init_addr=par.dist_init_addr,
        curve_secret_file=par.curve_secret_file,
        join_timeout_s=par.join_timeout_s,
    )


def session_limit(cfg: EngineConfig) -> int:
    """Open sessions at most. With a host tier, `sessions.max_sessions`: an idle session
    holding a row gives it back (its KV demoted) when a request needs one. Without one, also
    the rows running requests leave spare, so idle sessions' KV is never dropped for rows."""
    if host_tier_bytes(cfg):
        return max(cfg.sessions.max_sessions, 0)
    spare_rows = cfg.kv.max_rows - cfg.scheduler.max_running_requests
    return max(min(cfg.sessions.max_sessions, spare_rows), 0)


def swa_pages(cfg: EngineConfig) -> int:
    """Pages of the sliding layers' own pool (0: none)."""
    return cfg.kv.num_pages if cfg.kv.swa_num_pages == -1 else cfg.kv.swa_num_pages


def sliding_window(cfg: EngineConfig) -> int:
    """The model's sliding window when its sliding layers get a pool of their own, else 0."""
    if swa_pages(cfg) == 0:
        return 0
    from kernels.models import load_config

    model = load_config(cfg.model.path or None)
    return int(model.sliding_window or 0) if model.sliding_layers else 0


_PLANS: dict[tuple, MemoryPlan] = {}  # the config's memory knobs -> its plan


def memory_plan(cfg: EngineConfig) -> MemoryPlan:
    """The KV pool's pages and the memory figures behind them, decided once per process for
    a model and its memory settings and logged (`memory_plan`; a warning when little is left).
    A model or pool that cannot fit is a `ConfigError` naming the figures and what to change.
    """
    mdl, kv = cfg.model, cfg.kv
    key = (
        mdl.path,
        mdl.dtype,
        mdl.device,
        mdl.quantization,
        mdl.linear,
        kv.page_size,
        kv.num_pages,
        kv.swa_num_pages,
        kv.context_len,
        kv.memory_fraction,
        kv.memory_bytes,
        cfg.scheduler.chunk_size,
    )
    if key in _PLANS:
        return _PLANS[key]
    from kernels.cpu import choose_dtype
    from kernels.device import choose_device
    from kernels.memory_plan import MemoryPlanError, available_memory, plan_memory
    from kernels.models import load_config, resolve_quantization

    try:
        device, _ = choose_device(mdl.device)
        dtype, _ = choose_dtype(mdl.dtype, device)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    path = mdl.path or None
    try:  # a model that cannot be read fails the start here, naming why
        model = load_config(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path {path or '(the embedded model)'}: {exc}") from None
    try:  # as the runner will resolve it
        quantization, _ = resolve_quantization(mdl.quantization, path, model, device)
    except ValueError as exc:
        raise ConfigError(f"model.quantization: {exc}") from None
    available, available_why = available_memory(device)
    dtype_name = str(dtype).removeprefix("torch.")
    try:
        plan = plan_memory(
            model,
            dtype=dtype_name,
            quantization=quantization,
            available=available,
            available_why=available_why,
            page_size=kv.page_size,
            num_pages=kv.num_pages,
            swa_num_pages=kv.swa_num_pages,
            context_len=kv.context_len,
            memory_fraction=kv.memory_fraction,
            memory_bytes=kv.memory_bytes,
            chunk_size=cfg.scheduler.chunk_size,
            device=device,
            linear=_linear_layout(mdl.linear, quantization, device, dtype),
        )
    except MemoryPlanError as exc:
        raise ConfigError(f"memory plan: {exc}") from None
    _log.info(
        "memory_plan",
        **plan.log_fields(),
        dtype=dtype_name,
        quantization=quantization,
        available_from=available_why,
    )
    for warning in plan.warnings:
        _log.warning("memory_plan_headroom", warning=warning)
    _PLANS[key] = plan
    return plan


def _linear_layout(requested: str, quantization: str, device: str, dtype) -> str:
    """The decoder linears' layout the runner will pick (`kernels.linear`), for the weights'
    size: irrelevant once quantized; an impossible request is left for the runner to refuse."""
    if quantization != "none":
        return "aten"
    import torch

    from kernels.linear import choose_linear_backend

    try:
        return choose_linear_backend(requested, torch.device(device), dtype)[0]
    except ValueError:
        return "aten"


_TOOL_FORMATS: dict[tuple[str, str, str], str] = {}  # (parser, chat_template, model) -> name


def tool_call_format(cfg: EngineConfig) -> str:
    """The tool-call format the server speaks: `server.tool_call_parser`, or for "auto" the
    one the chat template shows (Hermes when none does), decided once and logged. An
    unknown name is a `ConfigError`."""
    srv = cfg.server
    key = (srv.tool_call_parser, srv.chat_template, cfg.model.path)
    if key in _TOOL_FORMATS:
        return _TOOL_FORMATS[key]
    if srv.tool_call_parser == "auto":
        template = read_chat_template(cfg) or model_chat_template(cfg.model.path)
        name = resolve_tool_format("auto", template)
        why = "from the chat template" if template else "no chat template found: the default"
    else:
        try:
            name = resolve_tool_format(srv.tool_call_parser, None)
        except ValueError as exc:
            raise ConfigError(f"server.tool_call_parser: {exc}") from None
        why = "as configured"
    _log.info("tool_call_format", format=name, parser=srv.tool_call_parser, chosen=why)
    _TOOL_FORMATS[key] = name
    return name


def model_chat_template(model_path: str) -> str | None:
    """The model's own chat template, read from its files without loading the tokenizer:
    a folder's chat_template.jinja or tokenizer_config.json, a GGUF's metadata; None for the
    embedded model (Gemma 3 has no tool format) or when it cannot be read."""
    if not model_path:
        return None
    path = Path(model_path).expanduser()
    try:
        if path.is_dir():
            if (path / "chat_template.jinja").is_file():
                return (path / "chat_template.jinja").read_text()
            if (path / "tokenizer_config.json").is_file():
                value = json.loads((path / "tokenizer_config.json").read_text()).get(
                    "chat_template"
                )
                if isinstance(value, list):  # named templates: "default", else the first
                    named = {t.get("name"): t.get("template") for t in value}
                    value = named.get("default") or next(iter(named.values()), None)
                return value if isinstance(value, str) else None
            ggufs = sorted(path.glob("*.gguf"))
            path = ggufs[0] if len(ggufs) == 1 else path
        if path.is_file() and path.suffix == ".gguf":
            from gguf import GGUFReader

            field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
            value = field.contents() if field is not None else None
            return value if isinstance(value, str) else None
    except (OSError, ValueError) as exc:
        _log.warning("chat_template_unreadable", model=str(path), error=str(exc))
    return None


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
    _control_plane_thread()
    kv, sch, mdl = cfg.kv, cfg.scheduler, cfg.model
    group = cfg.engine.groups.get
    if kv.host_tier_bytes and not host_tier_bytes(cfg):
        _log.warning(
            "kv tiers off",
            reason="tensor parallelism: each rank's pool holds a share of every page",
            host_tier_bytes=kv.host_tier_bytes,
        )
    model_path = mdl.path or None
    plan = memory_plan(cfg)
    num_pages = plan.num_pages
    window = sliding_window(cfg)
    swa_num_pages = plan.swa_num_pages if window else 0
    specs = [
        ActorSpec(
            "runner",
            "actors.model_runner:ModelRunnerActor",
            dict(
                num_pages=num_pages,
                page_size=kv.page_size,
                max_rows=kv.max_rows,
                row_capacity=kv.context_len,
                model=model_path,
                dtype=mdl.dtype,
                device=mdl.device,
                cuda_graphs=mdl.cuda_graphs,
                attention=mdl.attention,
                linear=mdl.linear,
                compile=mdl.compile,
                threads=mdl.threads,
                own_process=runner_has_own_process(cfg),
                quantization=mdl.quantization,
                swa_num_pages=swa_num_pages,
                grammar_cache_bytes=cfg.engine.grammar_cache_bytes,
                store_dir=kv.store_dir if host_tier_bytes(cfg) else "",
                tensor_parallel_size=cfg.parallel.tensor_parallel_size,
                **multi_node(cfg),
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
                num_pages=num_pages,
                page_size=kv.page_size,
                max_rows=kv.max_rows,
                row_capacity=kv.context_len,
                radix="radix" if kv.radix else None,
                debug_checks=cfg.engine.debug_checks,
                swa_num_pages=swa_num_pages,
                sliding_window=window,
                swa_free_step=kv.swa_free_step,
                swa_free_prompt=kv.swa_free_prompt,
                session_max_pages=int(cfg.sessions.max_pinned_share * num_pages),
                host_tier_bytes=host_tier_bytes(cfg),
                disk_tier_bytes=kv.disk_tier_bytes if kv.store_dir else 0,
                disk_read_ahead_bytes=kv.disk_read_ahead_bytes,
                tier_prefix_blocks=kv.tier_prefix_blocks,
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
                sliding_window=window,
                speculative=msgspec.to_builtins(cfg.speculative),
                stage_sessions=bool(host_tier_bytes(cfg) and kv.store_dir and kv.disk_tier_bytes),
            ),
            group=group("scheduler", "main"),
        ),
        ActorSpec(
            "tokenizer",
            "actors.tokenizer.actor:TokenizerActor",
            dict(
                context_len=kv.context_len,
                kv_tokens=num_pages * kv.page_size,
                model=model_path,
                chat_template=read_chat_template(cfg),
                tool_call_parser=tool_call_format(cfg),
                max_in_flight=sch.max_running_requests + sch.max_waiting_requests,
                grammar_compile_timeout_s=cfg.engine.grammar_compile_timeout_s,
                grammar_max_bytes=cfg.engine.grammar_max_bytes,
                grammar_cache_bytes=cfg.engine.grammar_cache_bytes,
            ),
            group=group("tokenizer", "main"),
        ),
        ActorSpec(
            "sessions",
            "actors.sessions:SessionsActor",
            dict(
                context_len=kv.context_len,
                max_sessions=session_limit(cfg),
                default_ttl_s=cfg.sessions.default_ttl_s,
                max_ttl_s=cfg.sessions.max_ttl_s,
            ),
            group=group("sessions", "main"),
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
                dict(page_size=kv.page_size, sliding_window=window),
                group=group("radix", "main"),
            ),
        )
    return specs


def _control_plane_thread() -> None:
    """This thread runs actors, not the model: one torch thread (kernels.cpu.one_thread_here)."""
    from kernels.cpu import one_thread_here

    one_thread_here()


def serving_specs(cfg: EngineConfig, zmq_address: str | None = None) -> list[ActorSpec]:
    """The client-facing actors of `bin/engine serve`: the HTTP gateway (+ ZeroMQ endpoint)."""
    _control_plane_thread()
    srv = cfg.server
    plan = memory_plan(cfg)
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
                tool_call_parser=tool_call_format(cfg),
                reasoning_parser=srv.reasoning_parser,
                responses_max_stored=srv.responses_max_stored,
                responses_ttl_s=srv.responses_ttl_s,
                responses_max_sessions=srv.responses_max_sessions,
                allowed_origins=srv.allowed_origins,
                sse_keepalive_s=srv.sse_keepalive_s,
                stuck_after_s=srv.stuck_after_s,
                header_timeout_s=srv.header_timeout_s,
                body_timeout_s=srv.body_timeout_s,
                keepalive_timeout_s=srv.keepalive_timeout_s,
                max_connections=srv.max_connections,
                instance_id=srv.instance_id,
                watched_actors=core_actor_names(cfg),
                radix="radix" if cfg.kv.radix else None,
                # vllm:cache_config_info's labels, valued as vLLM writes them ("16",
                # "True"); the KV cache has the model's dtype ("auto" as vLLM's "auto");
                # the memory_* entries are the plan's figures, exported as gauges
                cache_config={
                    "block_size": str(cfg.kv.page_size),
                    "num_gpu_blocks": str(plan.num_pages),
                    "enable_prefix_caching": str(cfg.kv.radix),
                    "cache_dtype": cfg.model.dtype,
                    "memory_weights_bytes": str(plan.weights),
                    "memory_kv_pool_bytes": str(plan.kv_pool),
                    "memory_available_bytes": str(plan.available),
                },
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
