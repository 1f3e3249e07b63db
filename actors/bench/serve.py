"""`bin/engine bench serve`: load any OpenAI-compatible server, as SGLang's bench_serving does.

Datasets (all seeded, cut from a fixed English text so every server sees the same prompts):

* `random`: prompts of `--input-len` tokens (uniform in [len * (1 - range), len]) and as
  many output tokens, decoded to text;
* `shared-prefix`: one `--system-prompt-len`-token system prompt shared by every request,
  then a `--question-len`-token question of its own (what a prefix cache is for);
* `multi-turn`: `--num-prompts` conversations of `--turns` turns; each turn sends the whole
  conversation so far (as chat clients do), turns of one conversation one after another.
* `copy`: an answer that mostly quotes its prompt, as agents and editors produce (what n-gram /
  prompt-lookup drafting for speculative decoding is for). Each prompt is a document of about
  `--input-len` tokens (uniform in [len * (1 - range), len]), code-like (Python functions
  with identifiers and numbers) or prose (the fixed text, wrapped), then a line asking for it
  again (verbatim, with a function renamed, a number changed or a word replaced) and the
  first line or two of that copy. The prompt is plain completion text whose natural
  continuation is the rest of the copy, so a base model that follows no instructions copies
  too; sent to /v1/completions like `random`. Use `--output-len` near `--input-len` to copy
  the whole document.

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
import keyword
import math
import random
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from functools import lru_cache
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


# ---- the copy dataset ---------------------------------------------------------------------


@lru_cache(maxsize=1)
def _identifier_words() -> tuple[str, ...]:
    """Lowercase words of the fixed text, usable as parts of Python identifiers."""
    from actors.app.corpus import natural_text

    words = set(re.findall(r"\b[a-z]{3,9}\b", natural_text()))
    return tuple(sorted(w for w in words if not keyword.iskeyword(w)))


def _names(
    rng: random.Random, count: int, parts: int = 1, avoid: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    words = _identifier_words()
    out: list[str] = []
    while len(out) < count:
        name = "_".join(rng.choice(words) for _ in range(parts))
        if name not in out and name not in avoid:
            out.append(name)
    return out


_RESERVED = frozenset({"limit", "range", "max", "min", "self"})  # names the functions use


def _function(rng: random.Random, earlier: list[str]) -> list[str]:
    """One code-like Python function: identifiers, numbers, a loop, a branch, calls."""
    [name] = _names(rng, 1, parts=2, avoid=set(earlier))
    *params, acc = _names(rng, rng.randint(2, 4), avoid={name, *_RESERVED})
    [noun] = _names(rng, 1)
    lines = [
        f"def {name}({', '.join(params)}, limit={rng.randint(2, 64)}):",
        f'    """Return the {noun} of {params[0]}, at most {rng.randint(10, 9999)}."""',
        f"    {acc} = {rng.randint(0, 9)}",
    ]
    for _ in range(rng.randint(2, 5)):
        p = rng.choice(params)
        big, small = rng.randint(2, 999), rng.randint(2, 99)
        kind = rng.randrange(5 if earlier else 4)
        if kind == 0:
            lines.append(f"    {acc} += {p} * {big} - {small}")
        elif kind == 1:
            lines += [f"    if {acc} > {big}:", f"        {acc} = {acc} % {small}"]
        elif kind == 2:
            lines += ["    for i in range(limit):", f"        {acc} += {p}[i % {small}] * {big}"]
        elif kind == 3:
            lines.append(f"    {acc} = max({acc}, {p} // {small})")
        else:
            lines.append(f"    {acc} += {rng.choice(earlier)}({p}, limit={small})")
    lines.append(f"    return {acc}")
    return lines


def _tokens(source: TextSource, text: str) -> int:
    return len(source.bundle.encode(text, add_special_tokens=False))


def _fit(source: TextSource, parts: list[str], join, n: int, least: int) -> list[str]:
    """The longest head of `parts` (at least `least` of them) whose `join` is at most `n`
    tokens."""

    def fits(k: int) -> bool:
        return _tokens(source, join(parts[:k])) <= n

    lo, hi = min(least, len(parts)), len(parts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return parts[:lo]


def _code_document(rng: random.Random, source: TextSource, n: int) -> list[str]:
    """Functions of about `n` tokens in all, the last one cut at a line (at least two lines)."""
    lines: list[str] = []
    names: list[str] = []
    estimate = 0  # functions counted one by one: close to the whole, checked below
    while estimate < n or _tokens(source, "\n".join(lines)) < n:
        fn = _function(rng, names)
        names.append(fn[0][4 : fn[0].index("(")])
        lines += ([""] if lines else []) + fn
        estimate += _tokens(source, "\n".join(fn) + "\n\n")
    lines = _fit(source, lines, "\n".join, n, least=2)
    while not lines[-1]:
        lines.pop()
    return lines


def _prose_document(rng: random.Random, source: TextSource, n: int) -> list[str]:
    """About `n` tokens of the fixed text, whole words only, wrapped at 72 columns."""
    words = source.text(rng, n + 16).split()[1:-1] or ["text"]
    words = _fit(source, words, _wrap, n, least=1)
    return _wrap(words).split("\n")


def _wrap(words: list[str]) -> str:
    return textwrap.fill(" ".join(words), width=72) or "text"


def _replace_word(lines: list[str], old: str, new: str) -> list[str]:
    pattern = re.compile(rf"(?<![\w]){re.escape(old)}(?![\w])")
    return [pattern.sub(new, line) for line in lines]


def copy_prompt(rng: random.Random, source: TextSource, n: int) -> tuple[str, str, str]:
    """One `copy` request: (prompt, document, the copy it asks for). The prompt is the
    document, a line asking for it again, and the copy's first line or two, so that the
    natural continuation is the rest of the copy."""
    if rng.random() < 0.5:
        doc = _code_document(rng, source, n)
        choice = rng.randrange(3)
        numbers = sorted({m for line in doc for m in re.findall(r"(?<![\w.])\d{2,}\b", line)})
        if choice == 0:
            old = doc[0][4 : doc[0].index("(")]  # the first function: in the cue
            [new] = _names(rng, 1, parts=2, avoid={old})
            edit = f"the function `{old}` renamed to `{new}`"
        elif choice == 1 and numbers:
            old = rng.choice(numbers)
            new = str(int(old) + rng.randint(1, 9))
            edit = f"the number {old} changed to {new}"
        else:
            old = new = ""
            edit = "no changes"
        copy = _replace_word(doc, old, new) if old else list(doc)
        cue = copy[:2] if len(copy) > 2 else copy[:1]
        fence = "```python\n"
        ask = f"Here is the same code again, with {edit}:"
        prompt = fence + "\n".join(doc) + f"\n```\n\n{ask}\n\n" + fence + "\n".join(cue) + "\n"
    else:
        doc = _prose_document(rng, source, n)
        candidates = sorted({w for line in doc for w in re.findall(r"\b[A-Za-z]{4,}\b", line)})
        if candidates and rng.random() < 0.5:
            old = rng.choice(candidates)
            new = rng.choice([w for w in _identifier_words() if w != old.lower()])
            copy = _replace_word(doc, old, new)
            ask = f'Here is the same text again, with "{old}" replaced by "{new}":'
        else:
            copy = list(doc)
            ask = "Here is the same text again, quoted word for word:"
        cue = copy[:1]
        prompt = "\n".join(doc) + f"\n\n{ask}\n\n" + cue[0] + "\n"
    return prompt, "\n".join(doc), "\n".join(copy)


def build_dataset(args: argparse.Namespace, source: TextSource) -> list[Request]:
    rng = random.Random(args.seed)
    if args.dataset == "copy":
        out = []
        for _ in range(args.num_prompts):
            n = _length(rng, args.input_len, args.range_ratio)
            prompt, _, _ = copy_prompt(rng, source, n)
            out.append(
                Request(prompt=prompt, output_len=_length(rng, args.output_len, args.range_ratio))
            )
        return out
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
    if args.seed is not None and args.temperature > 0 and not args.unseeded:
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
    tpot = [tpot_of(o) for o in ok if o.output_tokens > 1]
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
        "tpot_s": _stats(tpot),
        "e2e_s": _stats([o.e2e for o in ok]),
        "samples": {
            "ttft_s": [o.ttft for o in ok],
            "e2e_s": [o.e2e for o in ok],
            "itl_s": itl,
            "tpot_s": tpot,
        },
    }


def tpot_of(outcome: Outcome) -> float:
    """A request's time per output token after its first (SGLang's and vLLM's TPOT). Its
    ITL samples are the gaps between chunks; a server that streams several tokens a chunk
    (speculative decoding) has fewer, longer gaps, and TPOT still compares per token."""
    return (outcome.e2e - outcome.ttft) / (outcome.output_tokens - 1)


def _print(summary: dict) -> None:
    c = summary["max_concurrency"]
    print(
        f"concurrency {c if c else 'unbounded'}: {summary['completed']} ok, "
        f"{summary['failed']} failed in {summary['duration_s']:.1f} s | "
        f"{summary['request_throughput']:.2f} req/s, output {summary['output_throughput']:.1f}"
        f" tok/s, total {summary['total_token_throughput']:.1f} tok/s | TTFT mean "
        f"{summary['ttft_s']['mean'] * 1e3:.0f} ms p99 {summary['ttft_s']['p99'] * 1e3:.0f} | "
        f"ITL mean {summary['itl_s']['mean'] * 1e3:.1f} ms p99 "
        f"{summary['itl_s']['p99'] * 1e3:.1f} | TPOT mean {summary['tpot_s']['mean'] * 1e3:.1f}"
        f" ms | E2E mean {summary['e2e_s']['mean']:.2f} s | "
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
    p.add_argument(
        "--dataset",
        choices=["random", "shared-prefix", "multi-turn", "copy"],
        default="random",
        help="copy: the answer quotes the prompt (a document, then the start of its copy), "
        "for n-gram / prompt-lookup speculative decoding; see the module docstring",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens (copy: document tokens)"
    )
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
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
    p.add_argument(
        "--unseeded",
        action="store_true",
        help="sampled requests carry no seed (kvactor drafts for unseeded ones only)",
    )
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
