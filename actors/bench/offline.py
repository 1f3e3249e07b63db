"""`bin/engine bench offline`: the same prompts through kvactor's offline API, through a bare
loop over the model executor, and through HF transformers' batched `generate`, in one run.

Prompts are `--num-prompts` windows of a fixed English text with lengths uniform in
[`--min-len`, `--max-len`] tokens; every request generates exactly `--new-tokens` tokens,
greedy (EOS ignored). The bare loop (`--bare`) is what the engine would be with no actors,
messages, scheduling or detokenization: the model executor and the sampler, with the
engine's dtype and threads, prefilling `max_batch_tokens` at a time and then decoding every
request together; engine / bare is the serving stack's efficiency. HF runs at each batch
size of `--hf-batches` (left-padded, fp32) and its best one is the baseline.
"""

from __future__ import annotations

import argparse
import random
import time

import anyio

from actors.app.config import load_config
from actors.app.corpus import natural_text
from actors.app.serving import ServingEngine
from transport.messages.params import GenerationParams


def prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    while len(ids) < hi + 10:
        ids = ids + ids
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append([tokenizer.bos_id, *ids[start : start + length - 1]])
    return out


async def run_kvactor(
    cfg, batch: list[list[int]], new_tokens: int, warmup: list[list[int]] | None = None
) -> dict:
    """`warmup`: prompts run first, untimed, a few tokens each (give ones of the batch's
    shape but other tokens: the engine's decode graphs for that size are captured then,
    and the timed prompts get no prefix-cache hits from them)."""
    async with ServingEngine(cfg) as eng:
        return await timed_batch(eng, batch, new_tokens, warmup)


async def timed_batch(
    eng: ServingEngine, batch: list[list[int]], new_tokens: int, warmup: list[list[int]] | None
) -> dict:
    """`run_kvactor` on an engine that is already running (one engine, many batches)."""
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    await eng.generate_batch(
        warmup or [batch[0][:8]], GenerationParams(max_tokens=3, temperature=0)
    )
    before = await eng.scheduler_stats()
    t = time.perf_counter()
    results = await eng.generate_batch(batch, params)
    wall = time.perf_counter() - t
    after = await eng.scheduler_stats()
    out = sum(len(r.token_ids) for r in results)
    busy = after.runner_busy_s - before.runner_busy_s
    steps = after.steps - before.steps
    return {
        "wall_s": wall,
        "output_tokens": out,
        "output_tok_s": out / wall,
        "runner_busy_share": busy / wall,
        "steps": steps,
        "gap_ms": (wall - busy) / max(steps, 1) * 1e3,
    }


def run_bare(cfg, batch: list[list[int]], new_tokens: int) -> dict:
    """The model executor and sampler alone, over the same prompts and budgets."""
    import torch

    from actors.bench.bare_executor import bare_executor
    from kernels.cpu import choose_dtype, choose_threads
    from kernels.device import choose_attention, choose_device
    from kernels.models import load_model
    from kernels.sampling import Sampler

    device, _ = choose_device(cfg.model.device)
    dtype, _ = choose_dtype(cfg.model.dtype, device)
    attention, _ = choose_attention(cfg.model.attention, device, dtype)
    threads, _ = choose_threads(cfg.model.threads, own_process=False)
    torch.set_num_threads(threads)
    config, model = load_model(cfg.model.path or None, dtype)
    model = model.to(device)
    rows = len(batch)
    capacity = max(len(p) for p in batch) + max(new_tokens, 3) + 1
    executor = bare_executor(
        config,
        model,
        rows,
        capacity,
        validate=False,
        attention=attention,
        cuda_graphs=cfg.model.cuda_graphs,
        linear=cfg.model.linear,  # the engine's weight layout, or the two loops differ
    )
    sampler = Sampler()
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for rid in range(rows):
        sampler.add_request(rid, params, [])
    sch = cfg.scheduler
    if device == "cuda":  # untimed: captures the decode graphs of this batch size
        _bare_loop(executor, sampler, batch, sch.max_batch_tokens, sch.chunk_size, 3)
    t = time.perf_counter()
    produced = _bare_loop(
        executor, sampler, batch, sch.max_batch_tokens, sch.chunk_size, new_tokens
    )
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall}


def _bare_loop(
    executor, sampler, batch: list[list[int]], budget: int, chunk: int, new_tokens: int
) -> int:
    """`new_tokens` for every prompt of `batch` (rows 0..n-1 of the executor): prefill under
    the token budget, chunked like the engine, then decode them all; tokens produced."""
    from kernels.forward_batch import ForwardBatch

    rows = len(batch)
    last: list[int] = [0] * rows
    lens = [0] * rows
    pending = list(range(rows))
    while pending:  # prefill under the token budget, chunked like the engine
        take, group, starts, ids, need = budget, [], [], [], []
        while pending and take > 0:
            rid = pending[0]
            n = min(chunk, take, len(batch[rid]) - lens[rid])
            group.append(rid)
            starts.append(lens[rid])
            ids.append(batch[rid][lens[rid] : lens[rid] + n])
            lens[rid] += n
            take -= n
            done = lens[rid] == len(batch[rid])
            need.append(done)
            if done:
                pending.pop(0)
            else:
                break
        logits = executor.forward(ForwardBatch(group, starts, ids, need))
        sampled = [r for r, nd in zip(group, need) if nd]
        if sampled:
            for rid, tok in zip(sampled, sampler.sample(sampled, logits).tokens):
                last[rid] = tok
    produced = rows
    active = list(range(rows))
    for _ in range(new_tokens - 1):
        logits = executor.forward(
            ForwardBatch.decode(active, [lens[r] for r in active], [last[r] for r in active])
        )
        for rid, tok in zip(active, sampler.sample(active, logits).tokens):
            last[rid] = tok
            lens[rid] += 1
        produced += len(active)
    return produced


def run_hf(batch: list[list[int]], new_tokens: int, sizes: list[int], pad_id: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kernels.gguf_loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    kw = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id
    )
    by_size = {}
    with torch.inference_mode():
        model.generate(torch.tensor([batch[0][:8]]), max_new_tokens=2, do_sample=False)
        for size in sizes:
            t = time.perf_counter()
            for i in range(0, len(batch), size):
                group = batch[i : i + size]
                width = max(len(p) for p in group)
                ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                model.generate(ids, attention_mask=mask, **kw)
            wall = time.perf_counter() - t
            by_size[size] = len(batch) * new_tokens / wall
            print(f"HF fp32 batch {size}: {by_size[size]:.1f} tok/s ({wall:.1f} s)", flush=True)
    best = max(by_size, key=by_size.__getitem__)
    return {"by_batch_tok_s": by_size, "best_batch": best, "best_tok_s": by_size[best]}


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="bin/engine bench offline", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=50)
    ap.add_argument("--max-len", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-batches", default="8,16,32,64")
    ap.add_argument("--hf-threads", type=int, default=0, help="torch threads for HF (0: all)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--bare", action="store_true", help="also the bare executor loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    from kernels.tokenizer_loader import load_tokenizer

    cfg = load_config(args.config, args.set)
    tok = load_tokenizer(None)
    batch = prompts(tok, args.num_prompts, args.min_len, args.max_len, args.seed)
    ours = anyio.run(run_kvactor, cfg, batch, args.new_tokens)
    print(
        f"kvactor offline: {ours['output_tok_s']:.1f} tok/s ({ours['wall_s']:.1f} s, "
        f"{ours['output_tokens']} tokens)",
        flush=True,
    )
    print(
        f"runner busy (forward + sampling) {100 * ours['runner_busy_share']:.1f}% of the wall, "
        f"{ours['steps']} steps, {ours['gap_ms']:.1f} ms a step outside the runner "
        "(messages, scheduling, detokenization)",
        flush=True,
    )
    if args.bare:
        bare = run_bare(cfg, batch, args.new_tokens)
        print(
            f"bare executor loop: {bare['output_tok_s']:.1f} tok/s ({bare['wall_s']:.1f} s); "
            f"engine / bare = {ours['output_tok_s'] / bare['output_tok_s']:.2f}",
            flush=True,
        )
    if args.no_hf:
        return 0
    import torch

    if args.hf_threads:
        torch.set_num_threads(args.hf_threads)
    sizes = [int(s) for s in args.hf_batches.split(",")]
    hf = run_hf(batch, args.new_tokens, sizes, tok.pad_id or 0)
    print(
        f"ratio kvactor / HF best (batch {hf['best_batch']}): "
        f"{ours['output_tok_s'] / hf['best_tok_s']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
