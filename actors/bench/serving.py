"""`bin/engine bench serving`: what the client-facing layers add to a short request.

Starts an in-process `ServingEngine` with the HTTP gateway and the ZeroMQ endpoint, then
sends the same short greedy request (max_tokens=1 by default) round-robin through three
paths, interleaved so drift in machine load hits all of them alike:

* direct: `EngineClient.complete` inside the engine process (no client protocol at all);
* zmq:    the `KvactorClient` SDK over tcp to the ZeroMQ endpoint;
* http:   POST /v1/completions on one keep-alive connection (a minimal raw HTTP/1.1
          client, so client-library overhead is not measured as server overhead).

Clients run in the engine's own process and event loop (single machine, same CPUs).
Prints median / p90 / min latency per path and the median paired overhead over `direct`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import anyio

from actors.app.config import load_config
from actors.app.serving import ServingEngine
from actors.app.specs import serving_specs
from actors.bench.timing import Timings
from transport.address import pick_free_tcp_port
from transport.client import KvactorClient
from transport.messages.engine import GenerationParams

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me more:"


class RawHttpClient:
    """One keep-alive HTTP/1.1 connection; JSON bodies with Content-Length only."""

    def __init__(self, host: str, port: int, api_key: str | None = None) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()

    async def post_json(self, path: str, payload: dict) -> tuple[int, dict]:
        body = json.dumps(payload).encode()
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        request = head.encode() + body
        for attempt in range(2):
            if self._reader is None or self._reader.at_eof():
                await self.connect()
            assert self._reader is not None and self._writer is not None
            self._writer.write(request)
            status_line = await self._reader.readline()
            if status_line:
                break
            # The server closed the idle connection (keep-alive timeout) before reading it.
            self._reader = None
        else:
            raise ConnectionError("the server closed the connection twice")
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self._reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        data = await self._reader.readexactly(length)
        return status, json.loads(data)


async def _measure(args: argparse.Namespace) -> dict[str, list[float]]:
    cfg = load_config(args.config, args.set, **{"server.port": pick_free_tcp_port()})
    zmq_address = f"tcp://127.0.0.1:{pick_free_tcp_port()}"
    params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    payload = {
        "model": cfg.server.model_name,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    samples: dict[str, list[float]] = {"direct": [], "zmq": [], "http": []}
    async with ServingEngine(cfg, extra_specs=serving_specs(cfg, zmq_address)) as eng:
        http = RawHttpClient(cfg.server.host, cfg.server.port, cfg.server.api_key or None)
        await http.connect()
        try:
            async with KvactorClient(zmq_address) as zmq_client:

                async def via_direct() -> str:
                    return (await eng.client.complete(params, prompt=args.prompt)).text

                async def via_zmq() -> str:
                    return (await zmq_client.complete(prompt=args.prompt, params=params)).text

                async def via_http() -> str:
                    status, body = await http.post_json("/v1/completions", payload)
                    if status != 200:
                        raise RuntimeError(f"HTTP {status}: {body}")
                    return body["choices"][0]["text"]

                paths = {"direct": via_direct, "zmq": via_zmq, "http": via_http}
                for _ in range(args.warmup):
                    texts = {name: await fn() for name, fn in paths.items()}
                # Compared on the last round, where every path meets the same prefix cache.
                if len(set(texts.values())) != 1:
                    raise RuntimeError(f"the paths disagree on the greedy text: {texts}")
                order = list(paths)
                for i in range(args.requests):
                    # Rotate the order so no path always runs right after another.
                    for name in order[i % 3 :] + order[: i % 3]:
                        t0 = time.perf_counter()
                        await paths[name]()
                        samples[name].append(time.perf_counter() - t0)
        finally:
            await http.close()
    return samples


def _report(samples: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Per path: latency median / p90 / min, and the median over rounds of (path - direct)
    within the same round, which cancels most of the drift in machine load."""
    direct = samples["direct"]
    print(
        f"serving overhead: {args.requests} requests per path, max_tokens={args.max_tokens}, "
        "greedy, interleaved"
    )
    print(f"{'path':<8} {'median ms':>10} {'p90 ms':>10} {'min ms':>10} {'paired +ms':>11}")
    for name, values in samples.items():
        paired = statistics.median(v - d for v, d in zip(values, direct))
        print(
            f"{name:<8} {statistics.median(values) * 1e3:>10.2f} "
            f"{Timings(values).p(0.9) * 1e3:>10.2f} {min(values) * 1e3:>10.2f} "
            f"{paired * 1e3:>+11.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    if args.warmup < 1 or args.requests < 1:
        parser.error("--warmup and --requests must be >= 1")
    samples = anyio.run(_measure, args)
    _report(samples, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
