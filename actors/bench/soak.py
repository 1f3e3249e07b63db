"""bin/engine bench soak: steady load on a real server for N minutes, RSS of every engine
process sampled, KV checked for leaks at the end.

Starts `bin/engine serve` (its own process group; `--multi-process` puts the runner in a
child process), then keeps `--concurrency` clients busy with streaming completions of
random length, a share of them closed mid-stream. Every `--sample-s` seconds it records the
resident memory (VmRSS) of the server and of each of its descendants. After the load it
waits for the engine to go idle and reads the KV figures from /metrics.

Reported per process: RSS at the end of the warm-up, at the end, the growth in percent
and the slope after warm-up (MB per minute, least squares). Exit code 1 when any request
failed or the KV did not come back whole (a leak); memory growth is reported, not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from transport.address import pick_free_tcp_port

ROOT = Path(__file__).resolve().parents[2]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def process_name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(c.decode(errors="replace") for c in cmd if c)
    if "resource_tracker" in text:
        return "resource_tracker"
    if "multiprocessing.spawn" in text:
        return "child"
    return "server"


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mt) * (r - mr) for t, r in samples) / var * 60.0


@dataclass
class Load:
    ok: int = 0
    closed_early: int = 0
    failed: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def client_loop(
    base_url: str, stop_at: float, seed: int, load: Load, args: argparse.Namespace
) -> None:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge".split()
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as client:
        while time.monotonic() < stop_at:
            prompt = " ".join(
                rng.choice(words) for _ in range(rng.randint(10, args.max_prompt_words))
            )
            body = {
                "model": "gemma-3-270m",
                "prompt": prompt,
                "max_tokens": rng.randint(4, args.max_tokens),
                "temperature": 0.8,
                "stream": True,
            }
            leave_after = rng.randint(1, 4) if rng.random() < args.close_share else None
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        load.failed += 1
                        load.errors.append(f"HTTP {resp.status_code}")
                        continue
                    events = 0
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            break
                        if line.startswith("data: "):
                            events += 1
                            if '"error"' in line:
                                load.failed += 1
                                load.errors.append(line[:200])
                                break
                            if leave_after is not None and events >= leave_after:
                                break
                    load.tokens += events
                    if leave_after is not None and events >= leave_after:
                        load.closed_early += 1
                    else:
                        load.ok += 1
            except httpx.HTTPError as exc:
                load.failed += 1
                load.errors.append(f"{type(exc).__name__}: {exc}")


async def sample_loop(
    server_pid: int,
    stop_at: float,
    every_s: float,
    samples: dict[int, list],
    names: dict[int, str],
    t0: float,
) -> None:
    while time.monotonic() < stop_at:
        now = time.monotonic() - t0
        for pid in descendants(server_pid):
            rss = rss_mb(pid)
            if rss is not None:
                samples.setdefault(pid, []).append((now, rss))
                if pid not in names:
                    names[pid] = process_name(pid)
        await asyncio.sleep(every_s)


def kv_figures(base_url: str, headers: dict | None = None) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10, headers=headers).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (
                f"{{{','.join(f'{k}={v}' for k, v in labels.items())}}}" if labels else ""
            )
            out[key] = s.value
    return out


def wait_idle(
    base_url: str, timeout_s: float = 30.0, headers: dict | None = None
) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = kv_figures(base_url, headers)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if busy == 0 and m.get("kvactor:kv_request_records", 0) == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def start_server(args: argparse.Namespace, port: int, append: bool = False) -> subprocess.Popen:
    """`bin/engine serve` on `port` with `args.set`, once /health answers; its output goes
    to `args.log` (`append`: after what a previous server wrote there)."""
    cmd = [sys.executable, "-m", "actors.app.cli", "serve", "--port", str(port)]
    if args.multi_process:
        cmd += ["--set", "engine.transport=ipc", "--set", "engine.groups.runner=model"]
    for pair in args.set or []:
        cmd += ["--set", pair]
    log = open(args.log, "a" if append else "w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {args.log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy after 300 s; see {args.log}")


def report(samples: dict[int, list], names: dict[int, str], warmup_s: float) -> list[dict]:
    rows = []
    for pid, series in sorted(samples.items()):
        after = [(t, r) for t, r in series if t >= warmup_s]
        if len(after) < 2:
            continue
        start, end = after[0][1], after[-1][1]
        rows.append(
            {
                "pid": pid,
                "process": names.get(pid, "?"),
                "rss_after_warmup_mb": round(start, 1),
                "rss_end_mb": round(end, 1),
                "growth_pct": round(100.0 * (end - start) / start, 2),
                "slope_mb_per_min": round(slope_mb_per_min(after), 3),
                "samples": len(after),
            }
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bin/engine bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=None, help="default: 20%%, <= 3")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-prompt-words", type=int, default=120)
    p.add_argument("--close-share", type=float, default=0.2, help="streams closed mid-way")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--multi-process", action="store_true", help="runner in its own process")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    p.add_argument("--log", default="/tmp/kvactor-soak-server.log")
    p.add_argument("--output-json", default="")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warmup_min = args.warmup_minutes
    if warmup_min is None:
        warmup_min = min(3.0, args.minutes * 0.2)
    port = pick_free_tcp_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    load = Load()
    samples: dict[int, list] = {}
    names: dict[int, str] = {}
    try:
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60

        async def run() -> None:
            tasks = [
                client_loop(base_url, stop_at, seed, load, args) for seed in range(args.concurrency)
            ]
            sampler = sample_loop(proc.pid, stop_at, args.sample_s, samples, names, t0)
            await asyncio.gather(sampler, *tasks)

        asyncio.run(run())
        figures = wait_idle(base_url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = -9
    rows = report(samples, names, warmup_min * 60)
    total = figures.get("kvactor:kv_pages{state=free}", 0) + figures.get(
        "kvactor:kv_pages{state=tree}", 0
    )
    pages = figures.get("kvactor:kv_pages{state=held}", -1)
    leak = {
        "held_pages": pages,
        "request_records": figures.get("kvactor:kv_request_records", -1),
        "held_rows": figures.get("kvactor:kv_held_rows", -1),
        "free_plus_tree_pages": total,
        "idle_check_failures": figures.get("kvactor:kv_idle_check_failures_total", -1),
    }
    result = {
        "minutes": args.minutes,
        "warmup_minutes": warmup_min,
        "concurrency": args.concurrency,
        "multi_process": args.multi_process,
        "requests_ok": load.ok,
        "requests_closed_early": load.closed_early,
        "requests_failed": load.failed,
        "stream_events": load.tokens,
        "errors": load.errors[:10],
        "kv_after": leak,
        "server_exit_code": code,
        "processes": rows,
    }
    print(
        f"soak {args.minutes:g} min, concurrency {args.concurrency}: {load.ok} completed, "
        f"{load.closed_early} closed early, {load.failed} failed; server exit {code}"
    )
    print(f"KV after: {leak}")
    for row in rows:
        print(
            f"  {row['process']:<16} pid {row['pid']:<7} RSS {row['rss_after_warmup_mb']:8.1f}"
            f" -> {row['rss_end_mb']:8.1f} MB ({row['growth_pct']:+.2f}%, "
            f"{row['slope_mb_per_min']:+.3f} MB/min after warm-up)"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    leaked = leak["held_pages"] != 0 or leak["request_records"] != 0 or leak["held_rows"] != 0
    return 1 if load.failed or leaked or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
