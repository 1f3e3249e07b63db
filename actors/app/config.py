"""The engine's configuration as typed data: `configs/default.toml` decoded into structs.

Every TOML section is a `msgspec.Struct` with `forbid_unknown_fields`, so a config file or an
override with an unknown key, or a value of the wrong type, fails at load time with an error
naming the key (`ConfigError`), before any actor starts. Range checks that span sections
(`EngineConfig.validate`) run right after decoding.

Overrides are `"section.key" -> value` (values from `--set section.key=value` are parsed as
TOML scalars, falling back to the raw string): they are merged into the file's data before
decoding, so they get exactly the same checks.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from actors.reasoning import check_reasoning_parser

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "default.toml"


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelSection(_Section):
    path: str = ""  # "" = the embedded Gemma 3 270M; or a .gguf file / a Hugging Face folder
    # auto: bf16 where the CPU computes it natively, else fp32 (kernels/cpu.py)
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16"] = "auto"
    # auto: CUDA when torch sees a GPU, else the CPU (kernels/device.py)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: torch on the CPU; flashinfer on CUDA when installed, else triton
    attention: Literal["auto", "torch", "flashinfer", "triton"] = "auto"
    # decode steps as CUDA graphs per batch-size bucket (CUDA only; flashinfer or triton)
    cuda_graphs: bool = True
    # weight layout of the decoder linears and LM head (kernels/linear.py): auto = fp16 for
    # an fp32 model on the CPU (fbgemm), onednn+fp16 for a bf16 model on a CPU with native
    # bf16, else aten; aten = F.linear; onednn = oneDNN-packed; fp16 = fp16 weights, fp32
    # activations and accumulation (fp32 models on x86 CPUs); onednn+fp16 = oneDNN-packed bf16
    # plus fp16 copies for steps of at most 4 rows (bf16 models). In both fp16 layouts a
    # GGUF's own blocks (Q8_0, Q5_0, Q4_0, Q4_K, Q6_K) take those steps in place of the
    # fp16 copies, through a C kernel (kernels/gguf_blocks.py, kernels/q8_0.py)
    linear: Literal["auto", "aten", "onednn", "fp16", "onednn+fp16"] = "auto"
    threads: int = 0  # torch threads of the runner; 0 = auto (kernels/cpu.py)
    # small steps (decode, draft verification, short extends) as one torch.compile graph
    # (kernels/compiled_step.py), compiled in the background while serving eagerly: auto =
    # on the CPU except the exact path (float32 with aten linears); on; off
    compile: Literal["auto", "on", "off"] = "auto"
    # weight-only (kernels/quant.py): gguf = a GGUF's weights kept as stored, int4 where in
    # 4-bit blocks (Q4_0/Q4_1/Q4_K), int8 elsewhere; auto = gguf for a quantized GGUF you
    # give, exact for the embedded model and HF folders (kernels.models.resolve_quantization);
    # none = exact; int8 / int4 = every linear so, for any model
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = "auto"
    # generation defaults: "auto" = the model folder's generation_config.json (if any),
    # "none" = the engine's own, or a folder holding a generation_config.json
    generation_config: str = "auto"


class KvSection(_Section):
    page_size: int = 16
    num_pages: int = 2048
    # Size the KV pool from memory instead (kernels/memory_plan.py; num_pages is then
    # computed, the sliding pool keeping its proportion): weights plus the pool may take
    # this share of the memory available at start (vLLM's gpu_memory_utilization; 0 = off) ...
    memory_fraction: float = 0.0
    memory_bytes: int = 0  # ... or the pool may take this many bytes (0 = off); one of the two
    # req-to-token rows: running requests, plus idle sessions holding KV; sessions get the
    # rows beyond scheduler.max_running_requests (at most sessions.max_sessions)
    max_rows: int = 80
    context_len: int = 4096  # tokens per request (prompt + output)
    radix: bool = True  # prefix caching
    # Sliding-window layers' own page pool (models with sliding layers, e.g. Gemma 3): their
    # pages are freed once the window has passed them. -1 = as many pages as num_pages;
    # 0 = no pool of their own (they keep every position, as full layers do); N = N pages.
    swa_num_pages: int = -1
    swa_free_step: int = 64  # window freeing acts in steps of at least this many tokens
    # false: only output the window has passed is freed, prompts keep their sliding KV (every
    # prefix stays reusable); true: prompts too (least memory; prefix hits cut to where
    # their last window is intact)
    swa_free_prompt: bool = False
    # The host tier below the pool: an idle session's KV, demoted when sessions pin more
    # than sessions.max_pinned_share of the pool or a request needs its pages, is copied to
    # host memory (at most this many bytes, least recently used dropped first) and loaded
    # back when its next turn arrives, instead of prefilled. 0 = no host tier.
    host_tier_bytes: int = 1 << 30
    # The disk tier below it: what overflows the host tier is written to files under this
    # folder (checksummed; one engine per folder) and read back on the session's next turn;
    # at most disk_tier_bytes, least recently used dropped first. A drain (SIGTERM) writes
    # the idle sessions there and the next start on the folder takes them back. "" = none.
    store_dir: str = ""
    disk_tier_bytes: int = 16 << 30
    # A returning session whose file is at least this big is read (and verified) beside
    # the steps before its turn is admitted, so other requests do not wait on the read; a
    # smaller one is read inline at the admission (the wait for the read-ahead would cost
    # the turn more than the read costs the others). 0 = read every one ahead.
    disk_read_ahead_bytes: int = 32 << 20
    # Prefix-tree blocks the pool evicts are copied to the host tier too (the same budget
    # and LRU as sessions' KV) and loaded by any request whose prompt starts with them, so
    # a popular system prompt survives pool pressure. Needs radix and a host tier.
    tier_prefix_blocks: bool = True


class SchedulerSection(_Section):
    max_running_requests: int = 64
    max_batch_tokens: int = 1024  # tokens per step: every decode token, then prefill chunks
    chunk_size: int = 512  # largest prefill chunk of one request in one step
    policy: Literal["fcfs", "lpm"] = "fcfs"
    max_waiting_requests: int = 256  # beyond running + this many, requests get HTTP 429
    new_token_ratio: float = 0.7  # share of max_tokens reserved at admission, decaying to
    min_new_token_ratio: float = 0.1  # this floor while no retraction happens


class SpeculativeSection(_Section):
    # Speculative decoding with drafters that need no second model: "ngram" (prompt lookup
    # in the request's own tokens), "suffix" (that, and earlier requests' outputs), "none".
    method: Literal["none", "ngram", "suffix"] = "ngram"
    num_speculative_tokens: int = 3  # draft tokens a request verifies per step at first
    max_speculative_tokens: int = 16  # doubled up to this while every draft is accepted
    prompt_lookup_min: int = 2  # the shortest tail n-gram a draft is looked up by
    prompt_lookup_max: int = 4  # the longest (tried first)
    # Decode requests in a step above which nobody drafts (the step is compute-bound)
    max_batch: int = 4
    suffix_max_entries: int = 200_000  # contexts the shared suffix index keeps, LRU


class SessionsSection(_Section):
    # open streaming sessions at most; without a host tier (kv.host_tier_bytes = 0) also at
    # most kv.max_rows - scheduler.max_running_requests (each idle one may keep a row)
    max_sessions: int = 1024
    default_ttl_s: float = 300.0  # a session idle this long closes itself (its KV released)
    max_ttl_s: float = 3600.0  # the longest idle timeout a client may ask for
    # Share of kv.num_pages idle sessions may pin between turns. Past it, and whenever a
    # request needs pages nothing else can give, the least recently used idle session's KV
    # goes to the prefix tree (cached, evictable); its next turn prefills what was lost.
    max_pinned_share: float = 0.5


class EngineSection(_Section):
    transport: Literal["inproc", "ipc", "tcp"] = "inproc"
    debug_checks: bool = False  # run the KV invariant checker after every allocator message
    groups: dict[str, str] = msgspec.field(default_factory=dict)  # actor -> process group
    # A runner that crashes (or whose process dies): "shutdown" stops the engine (exit 1);
    # "restart" ends its requests with an error, drops the prefix cache and starts a new one.
    runner_on_crash: Literal["shutdown", "restart"] = "shutdown"
    # Constrained output: a grammar that does not compile in this time, or compiles larger
    # than this, is refused (HTTP 400 naming the key); compiled grammars kept by the
    # tokenizer and by the runner, each at most this many bytes (least recently used dropped)
    grammar_compile_timeout_s: float = 5.0
    grammar_max_bytes: int = 16 << 20
    grammar_cache_bytes: int = 256 << 20


class ServerSection(_Section):
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # "" = no auth
    model_name: str = ""  # "" = the model's own name (the path given, or gemma-3-270m)
    aliases: list[str] = msgspec.field(default_factory=list)  # more names it answers to
    chat_template: str = ""  # "" = the model's; else a file path or the template itself
    # How tool calls are written and parsed: auto (from the chat template) | hermes |
    # llama3_json | mistral | pythonic | qwen3_coder
    tool_call_parser: str = "auto"
    reasoning_parser: str = ""  # "" = off; deepseek_r1 | qwen3: thinking split from answers
    responses_max_stored: int = 1024  # stored /v1/responses kept at most (oldest dropped)
    responses_ttl_s: float = 3600.0  # ... and for at most this long
    responses_max_sessions: int = 4  # sessions stored responses hold at once (KV kept)
    allowed_origins: list[str] = msgspec.field(default_factory=list)  # CORS; [] = off
    sse_keepalive_s: float = 5.0  # a stream silent this long gets an SSE comment
    stuck_after_s: float = 120.0  # /health: an actor on one message this long is down
    header_timeout_s: float = 10.0  # a request head not complete this long: 408, closed
    body_timeout_s: float = 30.0  # a request body not complete this long: 408, closed
    keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # open connections at most; more are refused with 503
    drain_timeout_s: float = 30.0  # on SIGTERM: running requests get this long to finish
    zmq_curve_secret_file: str = ""  # "" = plain ZeroMQ; else CURVE with this secret key
    # "" = none; else /health reports it as "instance": a launcher (the data-parallel
    # router) checks it reached the engine it started, not another on the same port
    instance_id: str = ""


class ParallelSection(_Section):
    # ranks the model is split across (kernels/tensor_parallel.py): torch.distributed, one
    # process per rank: gloo on the CPU (each on its own cores), NCCL on CUDA (one GPU each);
    # 1 = one runner holds the whole model
    tensor_parallel_size: int = 1
    # several machines (SGLang's flags): the ranks are split evenly over `nnodes` nodes;
    # node 0 runs the control plane and admits the others at `dist_init_addr` (HOST:PORT,
    # ZeroMQ with CURVE: every node holds the same key, `curve_secret_file`)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""
    curve_secret_file: str = ""
    join_timeout_s: float = 120.0  # nodes wait this long for each other at start
    # complete engines behind one router (actors/router.py): sessions and Responses chains
    # stay on their replica, other requests go where their prefix is cached, else to the
    # least busy; 1 = one engine, no router
    data_parallel_size: int = 1

    def checks(self) -> list[tuple[bool, str]]:
        one = self.nnodes == 1
        return [
            (self.nnodes >= 1, "parallel.nnodes must be >= 1"),
            (0 <= self.node_rank < self.nnodes, "parallel.node_rank must be in [0, nnodes)"),
            (
                self.tensor_parallel_size % self.nnodes == 0,
                "parallel.tensor_parallel_size must be a multiple of parallel.nnodes",
            ),
            (one or bool(self.dist_init_addr), "parallel.nnodes > 1 needs --dist-init-addr"),
            (
                one or bool(self.curve_secret_file),
                "parallel.nnodes > 1 needs parallel.curve_secret_file (the same key on "
                "every node: bin/engine zmq-keygen DIR)",
            ),
            (self.join_timeout_s > 0, "parallel.join_timeout_s must be > 0"),
            (self.data_parallel_size >= 1, "parallel.data_parallel_size must be >= 1"),
            (
                self.data_parallel_size == 1 or one,
                "parallel.data_parallel_size > 1 runs on one machine: nnodes must be 1",
            ),
        ]


class EngineConfig(_Section):
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    kv: KvSection = msgspec.field(default_factory=KvSection)
    scheduler: SchedulerSection = msgspec.field(default_factory=SchedulerSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    server: ServerSection = msgspec.field(default_factory=ServerSection)
    sessions: SessionsSection = msgspec.field(default_factory=SessionsSection)
    speculative: SpeculativeSection = msgspec.field(default_factory=SpeculativeSection)
    parallel: ParallelSection = msgspec.field(default_factory=ParallelSection)

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        **section__key: Any,
    ) -> EngineConfig:
        """Read a TOML config (default: `configs/default.toml`) and apply overrides.

        `overrides` are keyed "section.key"; keyword arguments "section__key" do the same
        (`EngineConfig.load(kv__num_pages=64)`). Raises `ConfigError` naming the bad key.
        """
        source = Path(path) if path else DEFAULT_CONFIG
        try:
            data = tomllib.loads(source.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {source}: {exc}") from None
        merged = dict(overrides or {})
        merged.update({k.replace("__", ".", 1): v for k, v in section__key.items()})
        for key, value in merged.items():
            _apply_override(data, key, value)
        try:
            cfg = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(_describe_validation_error(exc)) from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks; raises `ConfigError` naming the keys involved."""
        k, s = self.kv, self.scheduler
        checks = [
            (k.page_size >= 1, "kv.page_size must be >= 1"),
            (k.num_pages >= 1, "kv.num_pages must be >= 1"),
            (k.context_len >= 2, "kv.context_len must be >= 2"),
            (k.swa_num_pages >= -1, "kv.swa_num_pages must be -1 (as num_pages), 0 (off) or N"),
            (k.swa_free_step >= 1, "kv.swa_free_step must be >= 1"),
            (0.0 <= k.memory_fraction <= 1.0, "kv.memory_fraction must be in [0, 1] (0: off)"),
            (k.memory_bytes >= 0, "kv.memory_bytes must be >= 0 (0: off)"),
            (
                not (k.memory_fraction and k.memory_bytes),
                "kv.memory_fraction and kv.memory_bytes: set one of them, not both",
            ),
            (
                k.max_rows >= s.max_running_requests,
                "kv.max_rows must be >= scheduler.max_running_requests",
            ),
            (self.sessions.max_sessions >= 0, "sessions.max_sessions must be >= 0"),
            (self.kv.host_tier_bytes >= 0, "kv.host_tier_bytes must be >= 0"),
            (self.kv.disk_tier_bytes >= 0, "kv.disk_tier_bytes must be >= 0"),
            (self.kv.disk_read_ahead_bytes >= 0, "kv.disk_read_ahead_bytes must be >= 0"),
            (
                0.0 <= self.sessions.max_pinned_share <= 1.0,
                "sessions.max_pinned_share must be in [0, 1]",
            ),
            (
                0 < self.sessions.default_ttl_s <= self.sessions.max_ttl_s,
                "sessions: 0 < default_ttl_s <= max_ttl_s must hold",
            ),
            (s.chunk_size >= 1, "scheduler.chunk_size must be >= 1"),
            (
                s.max_batch_tokens > s.max_running_requests,
                "scheduler.max_batch_tokens must exceed scheduler.max_running_requests",
            ),
            (
                0.0 <= s.min_new_token_ratio <= s.new_token_ratio <= 1.0,
                "scheduler: 0 <= min_new_token_ratio <= new_token_ratio <= 1 must hold",
            ),
            (self.model.threads >= 0, "model.threads must be >= 0"),
            (
                self.parallel.tensor_parallel_size >= 1,
                "parallel.tensor_parallel_size must be >= 1",
            ),
            *self.parallel.checks(),
            (
                self.parallel.tensor_parallel_size == 1
                or not (k.memory_fraction or k.memory_bytes),
                "kv.memory_fraction / kv.memory_bytes do not size a tensor-parallel pool yet "
                "(each rank holds its own): set kv.num_pages",
            ),
            (
                self.speculative.num_speculative_tokens >= 1,
                "speculative.num_speculative_tokens must be >= 1",
            ),
            (
                1 <= self.speculative.prompt_lookup_min <= self.speculative.prompt_lookup_max,
                "speculative: 1 <= prompt_lookup_min <= prompt_lookup_max must hold",
            ),
            (
                self.speculative.max_speculative_tokens >= self.speculative.num_speculative_tokens,
                "speculative.max_speculative_tokens must be >= num_speculative_tokens",
            ),
            (self.speculative.max_batch >= 1, "speculative.max_batch must be >= 1"),
            (
                self.speculative.suffix_max_entries >= 1,
                "speculative.suffix_max_entries must be >= 1",
            ),
            (
                self.engine.grammar_compile_timeout_s > 0,
                "engine.grammar_compile_timeout_s must be > 0",
            ),
            (
                0 < self.engine.grammar_max_bytes <= min(self.engine.grammar_cache_bytes, 60 << 20),
                "engine: 0 < grammar_max_bytes <= grammar_cache_bytes (and <= 60 MiB: it must "
                "fit one message) must hold",
            ),
            (0 <= self.server.port <= 65535, "server.port must be in [0, 65535]"),
            (self.server.responses_max_stored >= 0, "server.responses_max_stored must be >= 0"),
            (self.server.responses_ttl_s > 0, "server.responses_ttl_s must be > 0"),
            (
                self.server.responses_max_sessions >= 0,
                "server.responses_max_sessions must be >= 0",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            check_reasoning_parser(self.server.reasoning_parser)
        except ValueError as exc:
            raise ConfigError(f"server.reasoning_parser: {exc}") from None


ENV_PREFIX = "KVACTOR_"


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """`KVACTOR_<SECTION>_<KEY>=value` for every config section (e.g. KVACTOR_KV_NUM_PAGES=64);
    other KVACTOR_* variables (KVACTOR_LOG_LEVEL, KVACTOR_CACHE, ...) are not config keys."""
    sections = {f.name for f in msgspec.structs.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        if section in sections and key:
            out[f"{section}.{key}"] = _scalar(raw)
    return out


def _scalar(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_overrides(pairs: Iterable[str] | None) -> dict[str, Any]:
    """`["kv.num_pages=64", ...]` -> `{"kv.num_pages": 64}` (values parsed as TOML scalars,
    else kept as the raw string, which the typed decode then accepts or names)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set expects section.key=value, got {pair!r}")
        out[key.strip()] = _scalar(raw)
    return out


def load_config(config_path: str | None, pairs: list[str] | None, **extra: Any) -> EngineConfig:
    """The config of a command (`bin/engine` and its benches): the file, then the
    environment, then `--set` pairs, then `extra` ("section.key"); exits with the message
    naming the bad key (before anything starts)."""
    try:
        overrides = env_overrides(os.environ)
        overrides.update(parse_overrides(pairs))
        overrides.update(extra)
        return EngineConfig.load(config_path, overrides)
    except ConfigError as exc:
        raise SystemExit(f"bin/engine: {exc}") from None


def _apply_override(data: dict[str, Any], key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    sections = msgspec.structs.fields(EngineConfig)
    by_name = {f.name: f for f in sections}
    if section not in by_name or not name:
        raise ConfigError(f"unknown config key {key}")
    section_type = by_name[section].type
    names = {f.name for f in msgspec.structs.fields(section_type)}
    head = name.split(".", 1)[0]
    if head not in names:
        raise ConfigError(f"unknown config key {section}.{head}")
    target = data.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"config section [{section}] must be a table")
    parts = name.split(".")
    for part in parts[:-1]:  # e.g. engine.groups.runner
        target = target.setdefault(part, {})
    target[parts[-1]] = value


def _describe_validation_error(exc: msgspec.ValidationError) -> str:
    """msgspec's "... - at `$.kv.num_pages`" as "config key kv.num_pages: ..."."""
    text = str(exc)
    what, sep, where = text.rpartition(" - at `$")
    if not sep:
        return f"invalid config: {text}"
    path = where.rstrip("`").lstrip(".")
    unknown = "Object contains unknown field `"
    if what.startswith(unknown):
        field = what[len(unknown) :].rstrip("`")
        return f"unknown config key {path + '.' if path else ''}{field}"
    return f"config key {path}: {what}"
