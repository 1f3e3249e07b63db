"""What another stream waits while a request extends a long cached prefix (docs/benchmarks.md,
2026-12-05 night). Serve the KV-heavy model of `disk_read_ahead.py --make-model` without
tiers, then run this against it:

    bin/engine serve /tmp/kv-heavy --max-model-len 4096 --set kv.num_pages=1100
    python docs/results/prefix_hit_stall.py --url http://127.0.0.1:8000

Each round: a 3,300-token prompt (cached by the prefix tree), then a 200-token stream and,
once it runs, the same prompt plus two tokens. Printed: the stream's three largest gaps
between tokens from that request's arrival on, with when each began.
"""

from __future__ import annotations

import argparse

import httpx
from disk_read_ahead import while_streaming, words  # the same folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    client = httpx.Client(base_url=args.url, timeout=600)
    model = client.get("/v1/models").json()["data"][0]["id"]

    def complete(prompt: str, max_tokens: int) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        answer.raise_for_status()
        return answer.json()

    for rnd in range(args.rounds):
        history = words(900 + rnd, 3300)
        complete(history, 4)
        hit, gaps = while_streaming(
            client, model, 50 + rnd, 200, 30, lambda: complete(history + " w5 w6", 2)
        )
        cached = hit["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
        print(f"round {rnd}: request {gaps}, cached {cached}", flush=True)


if __name__ == "__main__":
    main()
