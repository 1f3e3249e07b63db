"""bin/engine: serve | generate | bench.

  bin/engine serve [MODEL] [vLLM-style flags] [--zmq ADDR] [--config F] [--set k=v ...]
  bin/engine generate "prompt" [--max-tokens N] [--temperature T] [--top-p P] [--top-k K]
                      [--seed S] [--stop STR ...] [--chat] [--set k=v ...]
  bin/engine bench {transport,model,lm_head,engine,serving,serve,offline,quality,soak,
                    sessions,kv,grammar} [...]
  bin/engine gpu-check [--dry-run] [--json FILE]
  bin/engine zmq-keygen DIR

MODEL is a .gguf file or a Hugging Face folder (default: the embedded Gemma 3 270M).
Precedence, lowest first: the config file, KVACTOR_<SECTION>_<KEY> environment variables,
`--set section.key=value` (values parsed as TOML scalars), then the named flags.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import anyio

from actors.app.config import load_config

# flag, config key, type, help: the vLLM flags that mean the same thing here
SERVE_FLAGS = [
    ("--host", "server.host", str, "address to bind (default 127.0.0.1)"),
    ("--port", "server.port", int, "HTTP port (default 8000)"),
    (
        "--api-key",
        "server.api_key",
        str,
        "require the key: 'Authorization: Bearer KEY' on HTTP /v1, api_key on ZeroMQ",
    ),
    (
        "--zmq-curve-secret",
        "server.zmq_curve_secret_file",
        str,
        "CURVE-encrypt the ZeroMQ endpoint with this secret key file (bin/engine zmq-keygen)",
    ),
    ("--max-model-len", "kv.context_len", int, "tokens per request, prompt + output"),
    ("--dtype", "model.dtype", str, "auto | float32 | bfloat16 (auto: bf16 where native)"),
    (
        "--quantization",
        "model.quantization",
        str,
        "auto | none | int8 | int4 | gguf (weight-only)",
    ),
    ("--max-num-seqs", "scheduler.max_running_requests", int, "requests decoding at once"),
    (
        "--tensor-parallel-size",
        "parallel.tensor_parallel_size",
        int,
        "split the model across N rank processes (torch.distributed: gloo on the CPU, "
        "NCCL on CUDA with one GPU per rank)",
    ),
    (
        "--data-parallel-size",
        "parallel.data_parallel_size",
        int,
        "N complete engines behind a session- and prefix-aware router",
    ),
    ("--nnodes", "parallel.nnodes", int, "machines the ranks are spread over"),
    ("--node-rank", "parallel.node_rank", int, "this machine's index (0 runs the server)"),
    (
        "--dist-init-addr",
        "parallel.dist_init_addr",
        str,
        "HOST:PORT where node 0 admits the other nodes (CURVE: parallel.curve_secret_file)",
    ),
    ("--chat-template", "server.chat_template", str, "a chat template file (or its text)"),
    (
        "--tool-call-parser",
        "server.tool_call_parser",
        str,
        "auto | hermes | llama3_json | mistral | pythonic | qwen3_coder (auto: from the template)",
    ),
    (
        "--reasoning-parser",
        "server.reasoning_parser",
        str,
        "deepseek_r1 | qwen3: the model's <think> text as reasoning, apart from the answer",
    ),
    (
        "--generation-config",
        "model.generation_config",
        str,
        "auto | none | a folder with generation_config.json (request defaults)",
    ),
]


def serve_overrides(args) -> dict:
    """The config keys the serve command's MODEL and flags set."""
    out: dict = {}
    if args.model is not None:
        out["model.path"] = args.model
    for flag, key, _kind, _text in SERVE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out[key] = value
    if args.max_num_seqs is not None and not any(
        pair.startswith("kv.max_rows=") for pair in args.set or ()
    ):
        out["kv.max_rows"] = args.max_num_seqs  # a row for every request that may run
    if args.served_model_name:
        out["server.model_name"] = args.served_model_name[0]
        out["server.aliases"] = args.served_model_name[1:]
    if args.prefix_caching is not None:
        out["kv.radix"] = args.prefix_caching
    if args.allowed_origins:
        out["server.allowed_origins"] = args.allowed_origins
    if args.speculative_config is not None:
        out.update(speculative_overrides(args.speculative_config))
    return out


# vLLM's --speculative-config keys that mean the same here
SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
)


def speculative_overrides(text: str) -> dict:
    """The `speculative.*` keys vLLM's `--speculative-config` JSON sets; `ConfigError`
    naming what is not JSON or not supported here."""
    from actors.app.config import ConfigError

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict) or "method" not in spec:
        raise ConfigError('--speculative-config must be a JSON object with a "method"')
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ConfigError(
            f"--speculative-config: {unknown} not supported here; "
            f"supported keys: {list(SPECULATIVE_KEYS)} (methods: ngram, suffix, none)"
        )
    return {f"speculative.{key}": value for key, value in spec.items()}


def _config(args, **extra):
    return load_config(args.config, args.set, **extra)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve`'s MODEL and flags."""
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: embedded Gemma 3)",
    )
    serve.add_argument("--config", help="a TOML config (default: configs/default.toml)")
    for flag, _key, kind, text in SERVE_FLAGS:
        serve.add_argument(flag, type=kind, default=None, help=text)
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names requests may use (the first is the main one)",
    )
    serve.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action="store_true",
        default=None,
        help="prefix (radix) caching, on by default",
    )
    serve.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help='CORS origins ("*" for any); off by default',
    )
    serve.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding as vLLM\'s, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\' (methods: ngram, suffix)',
    )
    serve.add_argument("--zmq", help="ZeroMQ client endpoint, e.g. tcp://127.0.0.1:5557")
    serve.add_argument(
        "--role",
        choices=["engine", "router"],
        default="engine",
        help="router: only the router, in front of the --replica engines started elsewhere",
    )
    serve.add_argument(
        "--replica", action="append", default=[], metavar="URL", help="a replica's base URL"
    )
    serve.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="any config key, e.g. --set kv.num_pages=4096",
    )


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `bin/engine serve`'s arguments alone (for checks of commands written
    elsewhere, e.g. the Kubernetes example's)."""
    parser = argparse.ArgumentParser(prog="bin/engine serve", allow_abbrev=False)
    add_serve_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-check"]:  # its own parser owns every flag after it
        from actors.bench.gpu_check import main as gpu_check

        sys.argv = ["bin/engine gpu-check", *argv[1:]]
        return gpu_check()
    parser = argparse.ArgumentParser(
        prog="bin/engine", description="kvactor LLM serving engine", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="OpenAI-compatible HTTP server (+ ZeroMQ endpoint)",
        description="Serve MODEL over an OpenAI-compatible HTTP API. Flags mean what vLLM's do.",
    )
    add_serve_arguments(serve)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--config")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat turn")
    gen.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")

    sub.add_parser(  # dispatched above; listed for --help
        "gpu-check",
        help="prove the GPU runner on one device (parity, throughput, bandwidth); --dry-run: CPU",
    )

    keygen = sub.add_parser(
        "zmq-keygen", help="write a CURVE keypair for the ZeroMQ endpoint into DIR"
    )
    keygen.add_argument("dir")

    bench = sub.add_parser("bench", help="benchmarks (not tests)")
    bench.add_argument(
        "what",
        choices=[
            "transport",
            "model",
            "lm_head",
            "engine",
            "serving",
            "serve",
            "offline",
            "quality",
            "soak",
            "sessions",
            "kv",
            "grammar",
            "synthetic-gguf",
            "tp",
        ],
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    if args.cmd == "serve":
        node = _other_node(args)
        if node is None:
            node = _router(args, argv)
        return anyio.run(_serve, args) if node is None else node
    if args.cmd == "generate":
        return anyio.run(_generate, args)
    if args.cmd == "zmq-keygen":
        from transport.security import write_curve_keypair

        public, secret = write_curve_keypair(args.dir)
        print(f"secret key (serve --zmq-curve-secret): {secret}\npublic key (clients): {public}")
        return 0
    return _bench(args)


async def _generate(args) -> int:
    from actors.app.serving import ServingEngine
    from actors.frontends.base import GenerationError
    from transport.messages.engine import ChatMessage, GenerationParams

    params = GenerationParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    prompt = (
        {"messages": [ChatMessage(role="user", content=args.prompt)]}
        if args.chat
        else {"prompt": args.prompt}
    )
    async with ServingEngine(_config(args)) as eng:
        t0 = time.perf_counter()
        n = 0
        first = None
        try:
            async for chunk in eng.client.generate(params, **prompt):
                if chunk.token_ids and first is None:
                    first = time.perf_counter() - t0
                n += len(chunk.token_ids)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    reason = chunk.finish_reason
        except GenerationError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2
        total = time.perf_counter() - t0
        print(
            f"\n[{n} tokens, finish={reason}, ttft={first or 0:.2f}s, {n / total:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def exposure_warnings(cfg, zmq_address: str | None) -> list[str]:
    """What is reachable beyond this machine with no API key."""
    if cfg.server.api_key:
        return []
    out = []
    if not is_loopback(cfg.server.host):
        out.append(
            f"HTTP is bound to {cfg.server.host}, reachable from other machines, with no "
            "API key: anyone who can reach it can use it (set --api-key)"
        )
    if zmq_address and zmq_address.startswith("tcp://"):
        host = zmq_address.removeprefix("tcp://").rsplit(":", 1)[0]
        if not is_loopback(host):
            out.append(f"ZeroMQ is bound to {zmq_address} with no API key (set --api-key)")
    return out


def _other_node(args) -> int | None:
    """Serve as node J > 0 of several machines (`actors/app/node.py`): its exit code; None
    on node 0 or one machine."""
    from actors.app.config import ConfigError

    try:
        cfg = load_config(args.config, args.set, **serve_overrides(args))
    except ConfigError as exc:
        raise SystemExit(f"bin/engine: {exc}") from None
    if cfg.parallel.node_rank == 0:
        return None
    from actors.app.node import serve_node

    return serve_node(cfg)


def _router(args, argv: list[str]) -> int | None:
    """Serve as the data-parallel router (`actors/app/data_parallel.py`): its exit code;
    None for an engine."""
    cfg = load_config(args.config, args.set, **serve_overrides(args))
    if args.role == "router":
        if not args.replica:
            raise SystemExit("bin/engine: --role router needs --replica URL (one or more)")
    elif args.replica:
        raise SystemExit("bin/engine: --replica is for --role router")
    elif cfg.parallel.data_parallel_size == 1:
        return None
    if args.zmq:
        print(
            "bin/engine: warning: --zmq ignored: the router serves HTTP only (each replica's "
            "ZeroMQ endpoint is off)",
            file=sys.stderr,
            flush=True,
        )
    for warning in exposure_warnings(cfg, None):
        print(f"bin/engine: warning: {warning}", file=sys.stderr, flush=True)
    from actors.app.data_parallel import serve_router

    return serve_router(cfg, argv[1:], args.replica)


async def _serve(args) -> int:
    from actors.app.config import ConfigError
    from actors.app.model_info import served_names
    from actors.app.serving import ServingEngine
    from actors.app.specs import serving_specs

    try:
        overrides = serve_overrides(args)
    except ConfigError as exc:
        raise SystemExit(f"bin/engine: {exc}") from None
    cfg = load_config(args.config, args.set, **overrides)
    for warning in exposure_warnings(cfg, args.zmq):
        print(f"bin/engine: warning: {warning}", file=sys.stderr, flush=True)
    try:
        specs = serving_specs(cfg, zmq_address=args.zmq)
    except ConfigError as exc:
        raise SystemExit(f"bin/engine: {exc}") from None
    async with ServingEngine(cfg, extra_specs=specs) as eng:
        print(
            f"kvactor serving {', '.join(served_names(cfg))} on "
            f"http://{cfg.server.host}:{cfg.server.port}"
            + (f" and {args.zmq}" if args.zmq else ""),
            file=sys.stderr,
            flush=True,
        )
        crash = None  # stays None when a signal, not a crash, ends the serve loop
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                # SIGTERM / SIGINT: drain (no new requests, the running ones finish within
                # server.drain_timeout_s, the rest end with an error), then exit 0. A second
                # signal stops at once.
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        print(f"signal {signum}: draining", file=sys.stderr, flush=True)
                        async with anyio.create_task_group() as drain:

                            async def second_signal() -> None:
                                async for _ in signals:
                                    drain.cancel_scope.cancel()
                                    return

                            drain.start_soon(second_signal)
                            await eng.drain(cfg.server.drain_timeout_s)
                            drain.cancel_scope.cancel()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(on_signal)
            crash = await eng.system.wait_stopped()
            tg.cancel_scope.cancel()
    return 1 if crash is not None else 0


def _bench(args) -> int:
    sys.argv = [f"bench {args.what}", *args.rest]
    if args.what == "transport":
        from actors.bench.transport import main as run
    elif args.what == "model":
        from actors.bench.model import main as run
    elif args.what == "lm_head":
        from actors.bench.lm_head import main as run
    elif args.what == "serving":
        from actors.bench.serving import main as run
    elif args.what == "serve":
        from actors.bench.serve import main as run
    elif args.what == "offline":
        from actors.bench.offline import main as run
    elif args.what == "quality":
        from actors.bench.quality import main as run
    elif args.what == "soak":
        from actors.bench.soak import main as run
    elif args.what == "sessions":
        from actors.bench.sessions import main as run
    elif args.what == "kv":
        from actors.bench.kv import main as run
    elif args.what == "grammar":
        from actors.bench.grammar import main as run
    elif args.what == "synthetic-gguf":
        from actors.bench.synthetic_gguf import main as run
    elif args.what == "tp":
        from actors.bench.tensor_parallel import main as run
    else:
        from actors.bench.engine import main as run
    result = run()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
