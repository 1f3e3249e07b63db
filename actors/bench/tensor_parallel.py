"""`bin/engine bench tp`: step times of the model split across N ranks against one rank.

The same executor the runner builds (`kernels.model_executor.build_executor`), first whole in
this process with every core, then split (`kernels.tensor_parallel`): this process rank 0,
ranks 1..N-1 processes of their own, each pinned to its share of the cores. Prints prefill
tokens/s on one prompt and the decode step at each batch size (best of `--repeats` after a
warm-up), then the collectives a split step adds: one all-reduce of [batch, hidden] per
row-parallel product (2 per layer, 1 for the embedding) and one gather of the logits, each
timed alone on the group (the median of 100: a step waits on every one).

On one machine the split cannot beat the whole model: its ranks share the same cores and
memory bandwidth. On a machine with a NUMA node (its own cores and memory) per rank, a
decode step streams 1/N of the weights per node, so it is estimated as
    one-rank step / N + the measured collectives,
printed beside the measurement; an estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import os

import torch

from actors.bench.timing import time_calls
from kernels.forward_batch import ForwardBatch, SlotDeltas


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(1000, vocab // 4), min(vocab, 200_000), (count, length), generator=gen)
    return [[2] + row.tolist()[1:] for row in ids]


class _Steps:
    """An executor (whole or rank 0's) with row r owning slots [1 + r * capacity, ...)."""

    def __init__(self, executor, rows: int, capacity: int) -> None:
        self.executor = executor
        self.capacity = capacity
        self.mapping = SlotDeltas(
            rows=list(range(rows)),
            starts=[0] * rows,
            lengths=[capacity] * rows,
            flat_slots=list(range(1, rows * capacity + 1)),
        )

    def prefill(self, prompts: list[list[int]]) -> None:
        n = len(prompts)
        batch = ForwardBatch(list(range(n)), [0] * n, prompts, [True] * n, self.mapping)
        self.executor.forward(batch)

    def decode(self, lens: list[int], tokens: list[int]) -> None:
        # Re-decoding at the same position overwrites the same slot: a steady-state step.
        self.executor.forward(ForwardBatch.decode(list(range(len(lens))), lens, tokens))


def _pool(rows: int, capacity: int) -> dict:
    return dict(
        num_pages=rows * capacity,
        swa_num_pages=0,
        page_size=1,
        max_rows=rows,
        row_capacity=capacity,
    )


def _measure(steps: _Steps, vocab: int, args) -> dict[str, float]:
    out: dict[str, float] = {}
    prompt = _prompts(vocab, 1, args.prefill_len, seed=0)
    prefill = time_calls(lambda: steps.prefill(prompt), args.repeats).best
    out["prefill_tok_s"] = args.prefill_len / prefill
    for batch in args.batches:
        prompts = _prompts(vocab, batch, args.context, seed=batch)
        steps.prefill(prompts)
        lens, tokens = [args.context] * batch, [p[-1] for p in prompts]
        step = time_calls(lambda: steps.decode(lens, tokens), args.repeats).best
        out[f"decode_b{batch}_ms"] = step * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    from kernels.cpu import choose_dtype
    from kernels.model_executor import build_executor
    from kernels.models import load_model
    from kernels.tensor_parallel import (
        ParallelExecutor,
        RankSettings,
        build_rank,
        core_placement,
        launch,
        probe_collectives,
        stop_ranks,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: embedded)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (model.dtype)")
    parser.add_argument("--linear", default="auto", help="model.linear")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    dtype, why = choose_dtype(args.dtype, "cpu")
    rows, capacity = max(args.batches), max(args.prefill_len, args.context + 8)
    cores = sorted(os.sched_getaffinity(0))
    placement, per_rank, how = core_placement(args.ranks, cores)
    print(f"torch {torch.__version__}; {len(cores)} cores; dtype {dtype} ({why})", flush=True)

    results = {}
    with torch.inference_mode():
        torch.set_num_threads(len(cores))
        config, model = load_model(args.model, dtype)
        whole = build_executor(
            config,
            model,
            None,
            device="cpu",
            dtype=dtype,
            attention="torch",
            linear=args.linear,
            **_pool(rows, capacity),
        )
        print(f"1 rank, {len(cores)} threads, linear {whole.linear}", flush=True)
        results[1] = _measure(_Steps(whole, rows, capacity), config.vocab, args)
        del whole, model

        settings = RankSettings(
            model=args.model,
            dtype=str(dtype).removeprefix("torch."),
            attention="torch",
            linear=args.linear,
            threads=per_rank,
            world=args.ranks,
            cores=placement,
            **_pool(rows, capacity),
        )
        torch.set_num_threads(per_rank)
        if placement[0]:
            os.sched_setaffinity(0, placement[0])
        group, processes = launch(settings)
        try:
            _, local = build_rank(settings, group)
            split = ParallelExecutor(local, group)
            print(
                f"{args.ranks} ranks, {per_rank} thread(s) each on cores {placement} ({how}), "
                f"linear {local.linear}",
                flush=True,
            )
            results[args.ranks] = _measure(_Steps(split, rows, capacity), config.vocab, args)
            comm = {}
            for batch in args.batches:
                probe = (batch, config.hidden, -(-config.vocab // args.ranks), settings.dtype, 100)
                group.send(("probe", probe))
                comm[batch] = probe_collectives(group, *probe)
            group.send(("stop", ()))
        finally:
            stop_ranks(processes)

    one, many = results[1], results[args.ranks]
    print(
        f"\nprefill {args.prefill_len} tokens: 1 rank {one['prefill_tok_s']:.0f} tok/s, "
        f"{args.ranks} ranks {many['prefill_tok_s']:.0f} tok/s"
    )
    per_step = 2 * config.num_layers + 1  # all-reduces per step
    for batch in args.batches:
        reduce_s, gather_s = comm[batch]
        comm_ms = (per_step * reduce_s + gather_s) * 1e3
        a, b = one[f"decode_b{batch}_ms"], many[f"decode_b{batch}_ms"]
        print(
            f"decode batch {batch}: 1 rank {a:.1f} ms, {args.ranks} ranks {b:.1f} ms "
            f"({a / b:.2f}x); collectives {per_step} x {reduce_s * 1e6:.0f} us all-reduce + "
            f"{gather_s * 1e6:.0f} us gather = {comm_ms:.1f} ms; one NUMA node per rank "
            f"(estimate): {a / args.ranks + comm_ms:.1f} ms"
        )
