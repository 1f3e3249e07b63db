"""What another stream waits while a session returns from the disk tier (docs/benchmarks.md,
2026-12-05 night). `--make-model DIR` saves the KV-heavy random Llama the figures used; then
serve it (or Gemma) with a disk tier only and run this against the server:

    python docs/results/disk_read_ahead.py --make-model /tmp/kv-heavy
    bin/engine serve /tmp/kv-heavy --max-model-len 4096 --set kv.host_tier_bytes=1 \\
      --set kv.store_dir=/tmp/store --set sessions.max_pinned_share=0.0 \\
      --set kv.tier_prefix_blocks=false --set kv.num_pages=1100
    python docs/results/disk_read_ahead.py --url http://127.0.0.1:8000 --store-dir /tmp/store

Each round: a session's first turn (its history), filler prompts that push the history out
of the prefix tree, the session's file evicted from the page cache (a cold read), then a
300-token stream and, once it runs, the session's next turn. Printed: the stream's three
largest gaps between tokens from the turn's arrival on, with when each began.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import httpx


def make_model(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2000,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=256,  # 16 layers x 2 x 8 x 256 x 2 bytes: 128 KiB of KV a token
        num_hidden_layers=16,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, 2000)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    hf.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))


def words(seed: int, n: int) -> str:
    return " ".join(f"w{r}" for r in random.Random(seed).choices(range(4, 2000), k=n))


def while_streaming(client, model: str, seed: int, tokens: int, warm: int, send):
    """(send()'s answer, a report): a `tokens`-token stream runs; once it gave `warm`
    tokens, `send()` runs; the report has send's time, the stream's median gap and its
    three largest gaps from then on (ms, with when each began)."""
    stamps: list[float] = []

    def stream() -> None:
        body = {"model": model, "prompt": words(seed, 20), "max_tokens": tokens}
        body |= {"temperature": 0, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())

    thread = threading.Thread(target=stream)
    thread.start()
    while len(stamps) < warm:
        time.sleep(0.01)
    t0 = time.monotonic()
    answer = send()
    t1 = time.monotonic()
    thread.join()
    pairs = list(zip(stamps, stamps[1:], strict=False))
    top = sorted(((b - a, a - t0) for a, b in pairs if b >= t0), reverse=True)[:3]
    report = (
        f"{1e3 * (t1 - t0):.0f} ms; median gap "
        f"{1e3 * statistics.median(b - a for a, b in pairs):.0f} ms; largest gaps (ms, "
        f"began at ms): {[(round(g * 1e3), round(s * 1e3)) for g, s in top]}"
    )
    return answer, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--store-dir", default="/tmp/store")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--history", type=int, default=3300, help="the session's words (tokens)")
    ap.add_argument("--make-model", type=Path)
    args = ap.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return
    client = httpx.Client(base_url=args.url, timeout=600)
    model = client.get("/v1/models").json()["data"][0]["id"]

    def complete(prompt: str, max_tokens: int, **extra) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        answer = client.post("/v1/completions", json=body | extra)
        answer.raise_for_status()
        return answer.json()

    for rnd in range(args.rounds):
        sid = client.post("/v1/sessions", json={}).json()["id"]
        history = words(rnd * 5000, args.history)
        history += complete(history, 4, session_id=sid)["choices"][0]["text"]
        for j in range(4):
            complete(words(20000 + 3000 * j + rnd, 2100), 1)
        for file in Path(args.store_dir).rglob("*.kv"):
            fd = os.open(file, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

        def turn_two(sid: str = sid, history: str = history) -> dict:
            return complete(history + " w5 w6", 2, session_id=sid)

        turn, gaps = while_streaming(client, model, 40000 + rnd, 300, 40, turn_two)
        cached = turn["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
        print(f"round {rnd}: turn {gaps}, cached {cached}", flush=True)
        client.delete(f"/v1/sessions/{sid}")
    metrics = client.get("/metrics").text.splitlines()
    print([m for m in metrics if "disk_tier_reads_ahead" in m and not m.startswith("#")])


if __name__ == "__main__":
    main()
