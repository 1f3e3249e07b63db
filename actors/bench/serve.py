"""`bin/engine bench serve`: load any OpenAI-compatible server, as SGLang's bench_serving does.

Datasets (all seeded, cut from a fixed English text so every server sees the same prompts):

* `random`: prompts of `--input-len` tokens (uniform in [len * (1 - range), len]) and as
  many output tokens, decoded to text;
* `shared-prefix`: one `--system-prompt-len`-token system prompt shared by every request,
  then a `--question-len`-token question of its own (what a prefix cache is for);
* `multi-turn`: `--num-prompts` conversations of `--turns` turns; each turn sends the whole
  conversation so far (as chat clients do), turns of one conversation one after another.

Load: at most `--max-concurrency` requests in flight, and/or a Poisson `--request-rate`
(requests per second; `inf` sends all at once). `--concurrency-sweep 1,8,32` repeats the
run at each concurrency. Every request streams (`stream_options.include_usage`), so TTFT,
inter-token latency (ITL, between content chunks), end-to-end latency and token counts
come from the stream itself; cached prompt tokens from `usage.prompt_tokens_details`.

Writes one JSON document (`--output-json`) and, with `--plot-dir`, PNG plots: latency CDFs
per run, and throughput and TTFT against concurrency for a sweep. A benchmark only reports:
it never fails on a number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from actors.bench.timing import percentile


@dataclass
class Request:
    prompt: str | None = None  # completions
    messages: list[dict[str, str]] | None = None  # chat
    output_len: int = 128
    conversation: int = -1  # multi-turn: which conversation; turns run in order


@dataclass
class Outcome:
    ok: bool
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    responded: bool = False  # the server sent a status line
    retries: int = 0  # sends repeated after a stale keep-alive connection (at most 1)


# ---- datasets -----------------------------------------------------------------------------


class TextSource:
    """Token windows of a fixed text, decoded back to text with the target's tokenizer."""

    def __init__(self, tokenizer_path: str | None) -> None:
        from actors.app.corpus import natural_text
        from kernels.tokenizer_loader import load_tokenizer

        self.bundle = load_tokenizer(tokenizer_path)
        text = natural_text()
        self.ids = self.bundle.encode(text, add_special_tokens=False)
        while len(self.ids) < 20_000:
            self.ids = self.ids + self.ids

    def text(self, rng: random.Random, n: int) -> str:
        start = rng.randrange(0, len(self.ids) - n)
        return self.bundle.tokenizer.decode(self.ids[start : start + n])


def _length(rng: random.Random, n: int, range_ratio: float) -> int:
    return max(1, rng.randint(int(n * (1 - range_ratio)), n))


def build_dataset(args: argparse.Namespace, source: TextSource) -> list[Request]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return [
            Request(
                prompt=source.text(rng, _length(rng, args.input_len, args.range_ratio)),
                output_len=_length(rng, args.output_len, args.range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
    if args.dataset == "shared-prefix":
        system = source.text(rng, args.system_prompt_len)
        return [
            Request(
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": source.text(rng, args.question_len)},
                ],
                output_len=args.output_len,
            )
            for _ in range(args.num_prompts)
        ]
    # multi-turn: turn k of a conversation carries turns 0..k (answers filled in at run time)
    out = []
    for c in range(args.num_prompts):
        for _ in range(args.turns):
            out.append(
                Request(
                    messages=[{"role": "user", "content": source.text(rng, args.question_len)}],
                    output_len=args.output_len,
                    conversation=c,
                )
            )
    return out


# ---- one request --------------------------------------------------------------------------


async def run_request(
    client: httpx.AsyncClient, args: argparse.Namespace, req: Request, headers: dict[str, str]
) -> Outcome:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.seed is not None and args.temperature > 0:
        body["seed"] = args.seed
    if req.messages is not None:
        path = "/v1/chat/completions"
        body["messages"] = req.messages
    else:
        path = "/v1/completions"
        body["prompt"] = req.prompt
    out = Outcome(ok=False, start=time.perf_counter())
    for attempt in (1, 2):
        try:
            return await _stream_once(client, path, body, headers, out)
        except httpx.RemoteProtocolError as exc:
            # A pooled keep-alive connection the server had already closed (cpp-httplib,
            # llama-server's, closes one after 5 requests): the request never reached it, so
            # it is sent once more on a fresh connection, as HTTP clients do.
            if out.responded or attempt == 2:
                out.error = f"{type(exc).__name__}: {exc}"
                return out
            out.retries += 1
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            return out
    return out


async def _stream_once(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    out: Outcome,
) -> Outcome:
    last = out.start
    parts: list[str] = []
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        out.responded = True
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    if not parts:
                        out.ttft = now - out.start
                    else:
                        out.itl.append(now - last)
                    last = now
                    parts.append(piece)
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens", 0)
                out.output_tokens = usage.get("completion_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens") or 0
    out.e2e = time.perf_counter() - out.start
    out.text = "".join(parts)
    out.ok = True
    if not out.output_tokens:
        out.output_tokens = len(parts)  # a server without usage in streams: one per chunk
    return out


# ---- a run --------------------------------------------------------------------------------


async def run_load(
    args: argparse.Namespace, dataset: list[Request], concurrency: int | None
) -> tuple[list[Outcome], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or len(dataset), 1) + 4)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(args.seed + 1)
    results: list[Outcome | None] = [None] * len(dataset)
    conversations: dict[int, list[int]] = {}
    for i, req in enumerate(dataset):
        if req.conversation >= 0:
            conversations.setdefault(req.conversation, []).append(i)

    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout) as c:

        async def one(i: int, req: Request) -> None:
            if gate is None:
                results[i] = await run_request(c, args, req, headers)
                return
            async with gate:
                results[i] = await run_request(c, args, req, headers)

        async def conversation(indices: list[int]) -> None:
            history: list[dict[str, str]] = []
            for i in indices:
                turn = dataset[i]
                history = [*history, *(turn.messages or [])]
                await one(i, Request(messages=history, output_len=turn.output_len))
                answer = results[i].text if results[i] is not None else ""
                history = [*history, {"role": "assistant", "content": answer}]

        started = time.perf_counter()
        tasks = []
        units = (
            [(conversation, (idx,)) for idx in conversations.values()]
            if conversations
            else [(one, (i, r)) for i, r in enumerate(dataset)]
        )
        for fn, fn_args in units:
            tasks.append(asyncio.create_task(fn(*fn_args)))
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return [r for r in results if r is not None], duration


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 0.5),
        "p90": percentile(values, 0.9),
        "p99": percentile(values, 0.99),
    }


def summarize(outcomes: list[Outcome], duration: float, concurrency: int | None) -> dict:
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    output = sum(o.output_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    itl = [x for o in ok for x in o.itl]
    return {
        "max_concurrency": concurrency,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "resent_after_stale_connection": sum(o.retries for o in outcomes),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_tokens": prompt,
        "output_tokens": output,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_s": _stats([o.ttft for o in ok]),
        "itl_s": _stats(itl),
        "e2e_s": _stats([o.e2e for o in ok]),
        "samples": {
            "ttft_s": [o.ttft for o in ok],
            "e2e_s": [o.e2e for o in ok],
            "itl_s": itl,
        },
    }


def _print(summary: dict) -> None:
    c = summary["max_concurrency"]
    print(
        f"concurrency {c if c else 'unbounded'}: {summary['completed']} ok, "
        f"{summary['failed']} failed in {summary['duration_s']:.1f} s | "
        f"{summary['request_throughput']:.2f} req/s, output {summary['output_throughput']:.1f}"
        f" tok/s, total {summary['total_token_throughput']:.1f} tok/s | TTFT mean "
        f"{summary['ttft_s']['mean'] * 1e3:.0f} ms p99 {summary['ttft_s']['p99'] * 1e3:.0f} | "
        f"ITL mean {summary['itl_s']['mean'] * 1e3:.1f} ms p99 "
        f"{summary['itl_s']['p99'] * 1e3:.1f} | E2E mean {summary['e2e_s']['mean']:.2f} s | "
        f"cached {summary['cached_tokens']} tokens ({summary['cache_hit_rate']:.0%})",
        flush=True,
    )


def plot(runs: list[dict], plot_dir: Path, label: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "E2E")):
        for run in runs:
            values = sorted(run["samples"][key])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, ys, label=f"c={run['max_concurrency'] or 'all'}")
        ax.set_title(f"{title} CDF ({label})")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    path = plot_dir / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(str(path))
    if len(runs) > 1:
        xs = [r["max_concurrency"] or 0 for r in runs]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(xs, [r["output_throughput"] for r in runs], marker="o")
        a.set_title(f"output throughput vs concurrency ({label})")
        a.set_xlabel("max concurrency")
        a.set_ylabel("tokens / s")
        b.plot(xs, [r["ttft_s"]["mean"] for r in runs], marker="o", label="mean")
        b.plot(xs, [r["ttft_s"]["p99"] for r in runs], marker="o", label="p99")
        b.set_title("TTFT vs concurrency")
        b.set_xlabel("max concurrency")
        b.set_ylabel("seconds")
        b.legend()
        for ax in (a, b):
            ax.grid(True, alpha=0.3)
        path = plot_dir / "vs_concurrency.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bin/engine bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="gemma-3-270m", help="the model name the server serves")
    p.add_argument("--api-key", default="")
    p.add_argument("--tokenizer", default=None, help="GGUF or HF folder (default: embedded)")
    p.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn"], default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths uniform in [len * (1 - r), len]",
    )
    p.add_argument("--system-prompt-len", type=int, default=1000)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--concurrency-sweep", default="", help="e.g. 1,8,32")
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM/SGLang/kvactor extension) for fixed lengths",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--label", default="", help="name of the server in the output")
    p.add_argument("--output-json", default="")
    p.add_argument("--plot-dir", default="")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = TextSource(args.tokenizer)
    dataset = build_dataset(args, source)
    sweep = [int(x) for x in args.concurrency_sweep.split(",") if x.strip()]
    levels = sweep or [args.max_concurrency]
    label = args.label or args.base_url
    runs = []
    for level in levels:
        outcomes, duration = asyncio.run(run_load(args, dataset, level))
        summary = summarize(outcomes, duration, level)
        _print(summary)
        runs.append(summary)
    document = {
        "label": label,
        "base_url": args.base_url,
        "model": args.model,
        "dataset": args.dataset,
        "config": {
            k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
            if k != "api_key"
        },
        "runs": runs,
    }
    if args.plot_dir:
        document["plots"] = plot(runs, Path(args.plot_dir), label)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
