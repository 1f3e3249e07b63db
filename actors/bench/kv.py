"""bin/engine bench kv: what sliding-window freeing saves, measured on the real ledger.

Drives the allocator's `KvLedger` (the code the engine runs, with a local prefix tree) the
way the scheduler does: prefill in chunks, then one decode slot per step, up to
`--context` tokens. It reports, per request, the full-attention pages and sliding-layer
pages it holds at the end, weighted by the layers that store them (the model's full and
sliding layer counts), with window freeing off (one pool, every layer keeps every position)
and on (sliding layers in a pool of their own; prompts kept, and prompts freed too). Then
how many such requests fit side by side: in the default pools, and in a split of the same
KV memory between the two pools chosen for these requests, both by running them.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from actors.allocator.ledger import KvLedger
from actors.allocator.prefix_port import LocalPrefixPort, run_sync
from actors.app.config import EngineConfig
from kvcore import PagePool, RadixTree, ReqToTokenTable, SwaPages


def make(full_pages: int, swa_pages: int, ps: int, window: int, free_prompt: bool, rows: int):
    ledger = KvLedger(
        PagePool(full_pages, ps),
        ReqToTokenTable(rows, 1 << 16),
        LocalPrefixPort(RadixTree(ps)),
    )
    if swa_pages:
        ledger.swa = SwaPages(full_pages, swa_pages, ps)
        ledger.window = window
        ledger.swa_free_prompt = free_prompt
    return ledger


def grow(ledger: KvLedger, rids: list[int], prompt: int, context: int, chunk: int) -> bool:
    """Prefill and decode every request to `context` tokens, side by side; False as soon as
    any step is refused (they do not fit)."""
    rng = np.random.default_rng(0)
    tokens = {rid: rng.integers(10, 250_000, context).astype(np.int64) for rid in rids}
    for rid in rids:
        done = 0
        while done < prompt:
            g = run_sync(ledger.alloc_extend(rid, tokens[rid][:prompt], chunk, []))
            if g is None:
                return False
            done = g.end
            if done < prompt:
                run_sync(ledger.cache_unfinished(rid, tokens[rid], []))
        # Its first decode step follows its prefill (the next step, as the scheduler runs).
        if run_sync(ledger.alloc_decode([rid], [])):
            return False
    for _ in range(context - prompt - 1):
        if run_sync(ledger.alloc_decode(rids, [])):
            return False
    return True


def held(ledger: KvLedger, rid: int) -> tuple[int, int]:
    """(full pages, sliding pages) whose KV the request reads or owns."""
    rec = ledger.records[rid]
    ps = ledger.page_size
    pages = ledger.table.table[rec.req_pool_idx, : rec.kv_allocated_len : ps] // ps
    full = len(pages)
    return full, (int(ledger.swa.mapped(pages).sum()) if ledger.swa is not None else full)


def fits(full_pages, swa_pages, ps, window, free_prompt, prompt, context, chunk) -> int:
    """The most requests that reach `context` side by side in these pools."""
    n = 0
    while True:
        ledger = make(full_pages, swa_pages, ps, window, free_prompt, rows=n + 2)
        if not grow(ledger, list(range(1, n + 2)), prompt, context, chunk):
            return n
        n += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/engine bench kv", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: embedded)")
    args = p.parse_args(argv)
    from kernels.models import load_config

    model = load_config(args.model)
    cfg = EngineConfig.load()
    ps, chunk = cfg.kv.page_size, cfg.scheduler.chunk_size
    n_sliding = len(model.sliding_layers)
    n_full = model.num_layers - n_sliding
    window = int(model.sliding_window or 0)
    if not n_sliding:
        print("this model has no sliding-window layers: nothing to free")
        return 0
    ctx = args.context
    big = ctx // ps + 8
    print(
        f"{model.num_layers} layers: {n_full} full, {n_sliding} sliding (window {window}); "
        f"page {ps} tokens; {ctx} tokens of context per request"
    )
    print("pages held by one request (layer-pages: pages x the layers that store them)")
    shapes = [("prompt 64 + output", 64), (f"prompt {ctx - 128} + 128 output", ctx - 128)]
    per_request = {}
    for label, prompt in shapes:
        off_ledger = make(big, 0, ps, window, False, rows=2)
        grow(off_ledger, [1], prompt, ctx, chunk)
        full, _ = held(off_ledger, 1)
        off = full * model.num_layers
        print(f"  {label}: off {full} pages = {off} layer-pages")
        for free_prompt in (False, True):
            ledger = make(big, big, ps, window, free_prompt, rows=2)
            grow(ledger, [1], prompt, ctx, chunk)
            f, s = held(ledger, 1)
            on = f * n_full + s * n_sliding
            per_request[(prompt, free_prompt)] = s
            name = "on, prompts freed too" if free_prompt else "on (default)"
            print(f"    {name}: {f} full + {s} sliding = {on} layer-pages ({on / off:.0%})")
    budget = cfg.kv.num_pages * model.num_layers  # the default pool's KV memory
    default_swa = cfg.kv.num_pages if cfg.kv.swa_num_pages == -1 else cfg.kv.swa_num_pages
    print(f"requests of {ctx} tokens that fit (default kv.num_pages={cfg.kv.num_pages}):")
    for label, prompt in shapes:
        off_n = fits(cfg.kv.num_pages, 0, ps, window, False, prompt, ctx, chunk)
        same = fits(cfg.kv.num_pages, default_swa, ps, window, False, prompt, ctx, chunk)
        # Split the same memory: full pages for all of them, sliding pages for their windows.
        s_each = per_request[(prompt, True)] + 2
        f_each = math.ceil(ctx / ps)
        n = budget // (f_each * n_full + s_each * n_sliding)
        f_pages, s_pages = n * f_each + 1, (budget - (n * f_each + 1) * n_full) // n_sliding
        split = fits(f_pages, s_pages, ps, window, True, prompt, ctx, chunk)
        print(
            f"  {label}: off {off_n}; on, default pools {same}; on, same memory split as "
            f"kv.num_pages={f_pages} kv.swa_num_pages={s_pages} kv.swa_free_prompt=true: {split}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
