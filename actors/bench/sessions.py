"""bin/engine bench sessions: many multi-turn sessions, with tool-call pauses between turns,
against a KV pool that holds only a fraction of them.

Starts `bin/engine serve` (its own process group; `--set` reaches its config), or measures
the server at `--url`. Each session runs `--turns` turns one after another; a turn sends the
whole conversation so far (the previous prompt, its answer, and about `--new-tokens` new
tokens of text) as a streaming completion on the session, greedy, `--output-tokens` tokens;
between turns the session idles `--pause-s` on average (a tool call). `--concurrency`
sessions run at once; with `--all-open`, every session is open from the start (the agents
all wait on their tools at once) and `--concurrency` bounds the turns in flight instead.

Reported: for turns after the first, the history the session held (previous prompt +
answer, less the last sampled token, which has no KV), how much of it came back cached, and
the re-prefilled tokens as a share of the history (what dropping idle sessions' KV would
re-prefill); TTFT per turn index (p50, p90); the host tier's figures from /metrics (bytes,
demotions, promotions, positions loaded, drops, failures) and the idle KV check.
`--verify N` re-sends every turn of N sessions without a session and with a cache salt of
its own (nothing reused) and compares the answers. `--restore-tokens T` times one session of
about T history tokens restored three ways: from the pool (the session kept it), from the
host tier (offloaded by the client's hint first) and by prefilling it (no session, a cache
salt of its own): the time to the first token of the next turn, one after the other.
`--restart-after-turn K` (with --all-open, on a server this command starts with a
`kv.store_dir`): once every session has answered K turns, the server gets SIGTERM (its drain
writes the idle sessions to the store) and starts again on the same store and port; turn
K + 1's cached share of its history is reported as `after_restart`, and the tier counters
add both servers' figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from actors.app.corpus import natural_text
from actors.bench.soak import start_server, wait_idle
from transport.address import pick_free_tcp_port


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    history_tokens: int = 0  # KV the session held before this turn (0 on the first)
    ttft_s: float = 0.0
    text: str = ""
    error: str = ""


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    prompts: dict[tuple[int, int], str] = field(default_factory=dict)


async def stream_completion(client: httpx.AsyncClient, body: dict) -> tuple[str, dict, float, str]:
    """(text, usage, seconds to the first text, error) of one streaming completion."""
    t0 = time.perf_counter()
    ttft, parts, usage = 0.0, [], {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return "", {}, 0.0, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "", {}, 0.0, str(chunk["error"])[:200]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    if not parts:
                        ttft = time.perf_counter() - t0
                    parts.append(choice["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(parts), usage, ttft, ""


def words_for(seed: int, vocabulary: list[str], n_tokens: int) -> str:
    """About `n_tokens` tokens of text: words drawn from the corpus, 1.6 Gemma 3 tokens
    each on average (1.49-1.70 over 20 draws of 1,000 tokens)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(max(1, round(n_tokens / 1.6))))


async def one_session(
    client: httpx.AsyncClient,
    model: str,
    index: int,
    args,
    vocabulary,
    run: Run,
    turn_slots: asyncio.Semaphore | None = None,
    gate: RestartGate | None = None,
) -> None:
    """The session's turns one after another; `turn_slots` (with --all-open) bounds the
    turns in flight across sessions; `gate` holds it after --restart-after-turn turns
    until the server is back."""
    rng = random.Random(args.seed * 1000 + index)
    sid = ""
    prompt, previous = "", None
    try:
        created = await client.post("/v1/sessions", json={"ttl_s": 3600})
        created.raise_for_status()
        sid = created.json()["id"]
        for k in range(args.turns):
            new = words_for(rng.randrange(1 << 30), vocabulary, args.new_tokens)
            prompt = f"{prompt}{previous.text if previous else ''}\n{new}\n"
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "session_id": sid,
            }
            try:
                async with turn_slots or contextlib.nullcontext():
                    text, usage, ttft, error = await stream_completion(client, body)
            except httpx.HTTPError as exc:  # this session's turn fails; the others go on
                text, usage, ttft, error = "", {}, 0.0, f"{type(exc).__name__}: {exc}"
            turn = Turn(index, k, ttft_s=ttft, text=text, error=error)
            if usage:
                turn.prompt_tokens = usage["prompt_tokens"]
                turn.completion_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens") or 0
            if previous is not None and not previous.error:
                turn.history_tokens = previous.prompt_tokens + previous.completion_tokens - 1
            run.turns.append(turn)
            run.prompts[(index, k)] = prompt
            previous = turn
            if gate is not None and k + 1 == args.restart_after_turn:
                await gate.arrive()
            if k + 1 < args.turns and args.pause_s > 0:
                await asyncio.sleep(rng.expovariate(1.0 / args.pause_s))
    finally:
        if gate is not None:
            gate.leave()  # a session that ends early does not hold the others
        if sid:
            await client.delete(f"/v1/sessions/{sid}")


class RestartGate:
    """Every session's arrival after its K-th turn, then one restart of the server, then
    all go on. A session that ends without arriving (an error) leaves instead. A restart
    that fails is raised in every session that arrived (none waits on forever)."""

    def __init__(self, parties: int, restart) -> None:
        self.waiting_for = parties
        self.restart = restart  # async () -> None
        self.arrived: set[asyncio.Task] = set()
        self.done = asyncio.Event()
        self.failed: BaseException | None = None
        self._restarts: set[asyncio.Task] = set()  # referenced until they end

    async def arrive(self) -> None:
        self.arrived.add(asyncio.current_task())
        await self._count_down()
        await self.done.wait()
        if self.failed is not None:
            raise RuntimeError("the server's restart failed") from self.failed

    def leave(self) -> None:
        task = asyncio.current_task()
        if task in self.arrived or self.done.is_set() or (task and task.cancelling()):
            return  # arrived already, too late to matter, or the whole run is ending
        self.arrived.add(task)
        pending = asyncio.ensure_future(self._count_down())
        self._restarts.add(pending)
        pending.add_done_callback(self._restarts.discard)

    async def _count_down(self) -> None:
        self.waiting_for -= 1
        if self.waiting_for == 0:
            try:
                await self.restart()
            except Exception as exc:  # raised in the sessions that arrived (`arrive`)
                self.failed = exc
            finally:
                self.done.set()


async def drive(base_url: str, args, restart=None) -> tuple[Run, dict]:
    """`restart` (async, with --restart-after-turn): stops the server and starts it again;
    it returns the first server's /metrics figures."""
    vocabulary = natural_text().split()
    run = Run()
    before: dict = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, headers=_auth(args)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        queue = list(range(args.sessions))

        async def worker() -> None:
            while queue:
                await one_session(client, model, queue.pop(0), args, vocabulary, run)

        if args.all_open:
            slots = asyncio.Semaphore(args.concurrency)
            gate = None
            if args.restart_after_turn:

                async def restart_server() -> None:
                    before.update(await restart())

                gate = RestartGate(len(queue), restart_server)
            await asyncio.gather(
                *(one_session(client, model, i, args, vocabulary, run, slots, gate) for i in queue)
            )
        else:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        checks = await verify(client, model, run, args)
        restore = await restore_probe(client, model, vocabulary, args)
    return run, {"verify": checks, "restore": restore, "before_restart": before}


async def verify(client, model: str, run: Run, args) -> dict:
    """Every turn of the first `--verify` sessions, again without a session: the same
    answer (greedy) is expected."""
    whole = {}  # session -> its turns, for the sessions whose every turn went through
    for t in run.turns:
        whole.setdefault(t.session, []).append(t)
    complete = sorted(i for i, ts in whole.items() if not any(t.error for t in ts))
    same = differ = 0
    differing = []
    for t in [t for index in complete[: args.verify] for t in whole[index]]:
        index = t.session
        body = {
            "model": model,
            "prompt": run.prompts[(index, t.turn)],
            "max_tokens": args.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_salt": f"verify-{index}-{t.turn}",
        }
        text, _, _, error = await stream_completion(client, body)
        if not error and text == t.text:
            same += 1
        else:
            differ += 1
            differing.append([index, t.turn, t.cached_tokens])
    out = {"same": same, "differ": differ}
    if differing:
        out["differing_session_turn_cached"] = differing
    return out


async def metric(client, name: str, every: bool = False) -> float:
    """A /metrics sample's value (`every`: the sum over its labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                if not every:
                    return sample.value
                total += sample.value
    return total


async def flush_prefix_cache(client, model: str, vocabulary) -> None:
    """Prompts of a salt of their own until the prefix tree has evicted as many pages as the
    pool holds: what it held before is gone."""
    total = await metric(client, "kvactor:kv_pages", every=True)
    start = await metric(client, "kvactor:kv_evicted_pages_total")
    for i in range(200):
        if await metric(client, "kvactor:kv_evicted_pages_total") - start >= total:
            return
        prompt = words_for(10_000 + i, vocabulary, 1000)
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": f"flush-{i}"}
        _, _, _, error = await stream_completion(client, body)
        if error:
            return


async def restore_probe(client, model: str, vocabulary, args) -> dict:
    """TTFT of a session's next turn with its history in the pool, in the host tier, and
    prefilled from nothing."""
    if not args.restore_tokens:
        return {}
    history = words_for(args.seed + 7, vocabulary, args.restore_tokens)
    out: dict = {}
    for way in ("pool", "host_tier"):
        sid = (await client.post("/v1/sessions", json={"ttl_s": 600})).json()["id"]
        body = {"model": model, "max_tokens": 1, "temperature": 0.0, "session_id": sid}
        salt = {"cache_salt": f"probe-{way}-{time.time_ns()}"}  # no tree hits across ways
        _, usage, _, error = await stream_completion(client, {**body, **salt, "prompt": history})
        if error:
            return {"error": error}
        out["history_tokens"] = usage["prompt_tokens"]
        if way == "host_tier":
            off = await client.post(f"/v1/sessions/{sid}/offload")
            out["offload_http_status"] = off.status_code
            held = off.json().get("held_tokens", 0) if off.status_code == 200 else 0
            if held < out["history_tokens"] - 1:
                # No host tier (or it could not keep it): nothing of the tier to time.
                out["host_tier_skipped"] = f"offload kept {held} of {out['history_tokens']}"
                await client.delete(f"/v1/sessions/{sid}")
                continue
            # Chunked prefill left the history's whole pages in the prefix tree: push them
            # out, so the next turn loads from the tier rather than hits the tree.
            if args.flush:
                await flush_prefix_cache(client, model, vocabulary)
        loaded = await metric(client, "kvactor:host_tier_loaded_tokens_total")
        nxt = {**body, **salt, "prompt": history + " and then", "max_tokens": 2}
        _, usage, ttft, error = await stream_completion(client, nxt)
        out[f"{way}_loaded_tokens"] = int(
            await metric(client, "kvactor:host_tier_loaded_tokens_total") - loaded
        )
        out[f"{way}_ttft_s"] = round(ttft, 4)
        out[f"{way}_cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0
        )
        await client.delete(f"/v1/sessions/{sid}")
    body = {"model": model, "max_tokens": 2, "temperature": 0.0}
    salt = {"cache_salt": f"probe-prefill-{time.time_ns()}"}
    _, _, ttft, _ = await stream_completion(
        client, {**body, **salt, "prompt": history + " and then"}
    )
    out["prefill_ttft_s"] = round(ttft, 4)
    for way in ("pool", "host_tier"):
        if out.get(f"{way}_ttft_s"):
            out[f"{way}_speedup"] = round(out["prefill_ttft_s"] / out[f"{way}_ttft_s"], 1)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def after_restart(run: Run, args) -> dict:
    """Turn K + 1 of every session (the first after the restart): its history, and how much
    of it came back cached from the store."""
    if not args.restart_after_turn:
        return {}
    first = [
        t
        for t in run.turns
        if t.turn == args.restart_after_turn and not t.error and t.history_tokens > 0
    ]
    history = sum(t.history_tokens for t in first)
    cached = sum(min(t.cached_tokens, t.history_tokens) for t in first)
    shares = sorted(min(t.cached_tokens, t.history_tokens) / t.history_tokens for t in first)
    return {
        "turns": len(first),
        "history_tokens": history,
        "cached_tokens": cached,
        "cached_share": round(cached / history, 4) if history else 0.0,
        "lowest_session_share": round(shares[0], 4) if shares else 0.0,
        "sessions_below_90pct": sum(1 for x in shares if x < 0.9),
    }


def summarize(run: Run, figures: dict, probes: dict, args) -> dict:
    before = probes.pop("before_restart", {}) or {}
    figures = dict(figures)
    for key, value in before.items():  # counters start again at 0 in the new server
        if key.split("{")[0].endswith("_total"):
            figures[key] = figures.get(key, 0) + value
    later = [t for t in run.turns if t.turn > 0 and not t.error]
    history = sum(t.history_tokens for t in later)
    reprefilled = sum(max(t.history_tokens - t.cached_tokens, 0) for t in later)
    ttft = {}
    for k in range(args.turns):
        xs = [t.ttft_s for t in run.turns if t.turn == k and not t.error]
        ttft[k] = {
            "p50_s": round(percentile(xs, 0.5), 4),
            "p90_s": round(percentile(xs, 0.9), 4),
            "p99_s": round(percentile(xs, 0.99), 4),
        }

    def f(name: str) -> float:
        return figures.get(name, 0)

    return {
        "sessions": args.sessions,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "turns_ok": sum(1 for t in run.turns if not t.error),
        "turns_failed": sum(1 for t in run.turns if t.error),
        "errors": [t.error for t in run.turns if t.error][:5],
        "mean_prompt_tokens_last_turn": round(
            statistics.mean([t.prompt_tokens for t in run.turns if t.turn == args.turns - 1])
            if run.turns
            else 0,
            1,
        ),
        "history_tokens": history,
        "reprefilled_tokens": reprefilled,
        "reprefilled_share": round(reprefilled / history, 4) if history else 0.0,
        "ttft_by_turn": ttft,
        "host_tier": {
            "bytes_used_at_end": f("kvactor:kv_host_tier_bytes{kind=used}"),
            "budget": f("kvactor:kv_host_tier_bytes{kind=budget}"),
            "demotes": f("kvactor:session_demotes_total"),
            "promotes": f("kvactor:session_promotes_total"),
            "loaded_tokens": f("kvactor:host_tier_loaded_tokens_total"),
            "drops": f("kvactor:host_tier_drops_total"),
            "failures": f("kvactor:host_tier_failures_total"),
            "spills_to_disk": f("kvactor:host_tier_spills_total"),
            "disk_bytes_used_at_end": f("kvactor:kv_disk_tier_bytes{kind=used}"),
            "disk_promotes": f("kvactor:disk_tier_promotes_total"),
            "prefix_block_demotes": f("kvactor:prefix_block_demotes_total"),
            "prefix_block_loaded_tokens": f("kvactor:prefix_block_loaded_tokens_total"),
        },
        "session_reclaims": f("kvactor:session_reclaims_total"),
        "kv_pages_total": f("kvactor:kv_pages{state=free}")
        + f("kvactor:kv_pages{state=tree}")
        + f("kvactor:kv_pages{state=session}")
        + f("kvactor:kv_pages{state=held}"),
        "idle_check_failures": f("kvactor:kv_idle_check_failures_total"),
        "after_restart": after_restart(run, args),
        **probes,
    }


def _auth(args) -> dict[str, str]:
    return {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bin/engine bench sessions", description=__doc__.split("\n")[0]
    )
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=300, help="new text per turn, about")
    p.add_argument("--output-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4, help="sessions running at once")
    p.add_argument(
        "--all-open",
        action="store_true",
        help="every session open from the start; --concurrency bounds the turns in flight",
    )
    p.add_argument("--pause-s", type=float, default=1.0, help="mean tool-call pause")
    p.add_argument(
        "--verify", type=int, default=4, help="sessions re-sent turn by turn without one"
    )
    p.add_argument("--restore-tokens", type=int, default=2000, help="0: no restore probe")
    p.add_argument(
        "--no-flush",
        dest="flush",
        action="store_false",
        help="time the tier load without first pushing the history out of the prefix tree "
        "(a history shorter than one prefill chunk leaves nothing there anyway)",
    )
    p.add_argument(
        "--restart-after-turn",
        type=int,
        default=0,
        metavar="K",
        help="with --all-open and a kv.store_dir: SIGTERM the server once every session "
        "answered K turns, start it again on the same store, and report turn K+1's cached "
        "share",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default="", help="a running server (else one is started)")
    p.add_argument("--api-key", default="", help="the running server's API key")
    p.add_argument("--multi-process", action="store_true", help="runner in its own process")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    p.add_argument("--log", default="/tmp/kvactor-sessions-server.log")
    p.add_argument("--output-json", default="")
    args = p.parse_args(argv)
    if args.restart_after_turn:
        if not 0 < args.restart_after_turn < args.turns:
            p.error("--restart-after-turn K needs 0 < K < --turns")
        if not args.all_open or args.url:
            p.error("--restart-after-turn needs --all-open and a server this command starts")
        if not any(pair.startswith("kv.store_dir=") and pair[13:] for pair in args.set or []):
            p.error("--restart-after-turn needs --set kv.store_dir=DIR (what a restart reads)")
    return args


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (the server drains), then SIGKILL its group after `timeout_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    base_url = args.url
    restart_s: list[float] = []
    if not base_url:
        port = pick_free_tcp_port()
        base_url = f"http://127.0.0.1:{port}"
        proc = start_server(args, port)

    async def restart() -> dict:
        """The first server's figures; then it drains (writing its sessions to the store)
        and a new one starts on the same store and port."""
        nonlocal proc
        figures = await asyncio.to_thread(wait_idle, base_url, 30.0, _auth(args))
        t = time.monotonic()
        await asyncio.to_thread(stop_server, proc, 600.0)
        if proc.returncode != 0:
            raise SystemExit(f"the server exited with {proc.returncode}; see {args.log}")
        proc = await asyncio.to_thread(start_server, args, port, True)
        restart_s.append(time.monotonic() - t)
        return figures

    try:
        t0 = time.monotonic()
        run, probes = asyncio.run(drive(base_url, args, restart))
        elapsed = time.monotonic() - t0
        figures = wait_idle(base_url, headers=_auth(args))
    finally:
        if proc is not None:
            stop_server(proc)
    result = summarize(run, figures, probes, args)
    result["elapsed_s"] = round(elapsed, 1)
    if restart_s:
        result["after_restart"]["stop_and_start_s"] = round(restart_s[0], 1)
    print(json.dumps(result, indent=2))
    if args.output_json:
        detail = {**result, "turn_records": [asdict(t) | {"text": ""} for t in run.turns]}
        Path(args.output_json).write_text(json.dumps(detail, indent=2))
    bad = (
        result["turns_failed"]
        or result["idle_check_failures"]
        or result["verify"]["differ"]
        or result["restore"].get("error")
        or result["after_restart"].get("sessions_below_90pct")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
