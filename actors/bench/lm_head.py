"""Benchmark the lm_head candidates (and the sampler) at decode batch sizes.

Run ``python -m actors.bench.lm_head`` (Gemma 3 270M head: V=262144, H=640). Prints one
markdown table per dtype: best and median wall ms per call for each backend at each N, and the
max error relative to F.linear's largest logit. ``--sampler`` adds a table of Sampler.sample
costs for common parameter mixes. Numbers on a shared machine are noisy: prefer the best column.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import msgspec
import torch
import torch.nn.functional as F
import torch.utils.mkldnn
from torch import Tensor

from actors.bench.timing import time_calls
from kernels.lm_head import LmHead
from kernels.q8_0 import Q8_0Weight
from kernels.q8_0 import kernel as q8_0_kernel
from kernels.q8_0 import kernel_status as q8_0_kernel_status
from kernels.sampling import Sampler
from transport.messages.params import GenerationParams

CHUNK_ROWS = 16384


def _time_ms(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(best, median) ms; the warm-up lets oneDNN build its primitive for the shape."""
    t = time_calls(fn, reps)
    return t.best * 1e3, t.median * 1e3


def _vocab_chunked(weight: Tensor) -> Callable[[Tensor], Tensor]:
    """logits^T computed CHUNK_ROWS vocabulary rows at a time into one [V, N] buffer."""

    def run(hidden: Tensor) -> Tensor:
        out = torch.empty(weight.shape[0], hidden.shape[0], dtype=weight.dtype)
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            torch.mm(
                weight[start : start + CHUNK_ROWS], hidden.t(), out=out[start : start + CHUNK_ROWS]
            )
        return out.t()

    return run


def _mkldnn_linear(weight: Tensor) -> Callable[[Tensor], Tensor]:
    """torch.utils.mkldnn.to_mkldnn on an nn.Linear (plain-layout oneDNN copy + to_dense)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    module = torch.utils.mkldnn.to_mkldnn(linear, weight.dtype)
    return lambda hidden: module(hidden)


def bench_head(
    vocab: int, hidden_size: int, sizes: list[int], reps: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).to(dtype)
    start = time.perf_counter()
    head = LmHead(weight)  # auto: keeps the oneDNN-packed copy whenever oneDNN exists
    pack_s = time.perf_counter() - start
    candidates: dict[str, Callable[[Tensor], Tensor]] = {
        name: functools.partial(head.run_backend, name) for name in head.available_backends()
    }
    candidates["chunked"] = _vocab_chunked(weight)
    candidates["MkldnnLinear"] = _mkldnn_linear(weight)
    if q8_0_kernel() is not None and hidden_size % 32 == 0:
        # a GGUF's Q8_0 blocks (of this random weight: its error is the blocks', which a
        # Q8_0 model's head has already; kernels/q8_0)
        candidates["q8_0"] = Q8_0Weight.quantize(weight.float()).packed().product
    else:
        print(f"q8_0: {q8_0_kernel_status()}")
    print(
        f"\n### {dtype}, V={vocab}, H={hidden_size}, threads={torch.get_num_threads()} "
        f"(oneDNN prepack {pack_s * 1e3:.0f} ms)\n"
    )
    print(
        "| backend | " + " | ".join(f"N={n} best / median ms" for n in sizes) + " | max rel err |"
    )
    print("|---|" + "---|" * (len(sizes) + 1))
    with torch.no_grad():
        for name, fn in candidates.items():
            cells, worst = [], 0.0
            for n in sizes:
                x = torch.randn(n, hidden_size, generator=generator).to(dtype)
                reference = F.linear(x.float(), weight.float())
                worst = max(
                    worst, ((fn(x).float() - reference).abs().max() / reference.abs().max()).item()
                )
                best, median = _time_ms(functools.partial(fn, x), reps)
                cells.append(f"{best:.1f} / {median:.1f}")
            print(f"| {name} | " + " | ".join(cells) + f" | {worst:.1e} |", flush=True)
    del candidates
    auto = LmHead(weight)
    print(f"\nLmHead(backend='auto') plan: {auto.plan}")


SAMPLER_MIXES: dict[str, GenerationParams] = {
    "greedy": GenerationParams(temperature=0.0),
    "temperature 0.8": GenerationParams(temperature=0.8),
    "top_p 0.95": GenerationParams(temperature=0.8, top_p=0.95),
    "top_k 50 + top_p 0.9": GenerationParams(temperature=0.7, top_k=50, top_p=0.9),
    "min_p 0.05": GenerationParams(min_p=0.05),
    "penalties + logprobs 5": GenerationParams(
        temperature=0.8,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logprobs=True,
        top_logprobs=5,
    ),
}


def _sample_fresh(sampler: Sampler, rids: list[int], copies: list[Tensor]) -> None:
    sampler.sample(rids, copies.pop())


def bench_sampler(
    vocab: int, sizes: list[int], reps: int, sampler_threads: int | None = None
) -> None:
    generator = torch.Generator().manual_seed(1)
    # Peaked like real LM logits: a few strong tokens over a wide low floor.
    base = torch.randn(max(sizes), vocab, generator=generator) * 2.0
    base[:, :64] += 12.0
    threads = sampler_threads or torch.get_num_threads()
    print(f"\n### Sampler.sample, V={vocab}, threads={threads} (ms, best / median)\n")
    print("| params | " + " | ".join(f"B={n}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for label, params in SAMPLER_MIXES.items():
        cells = []
        for n in sizes:
            sampler = Sampler(num_threads=sampler_threads)
            for rid in range(n):
                sampler.add_request(
                    rid, msgspec.structs.replace(params, seed=rid), list(range(rid, rid + 500))
                )
            rids = list(range(n))
            # sample() edits its logits in place: hand it a fresh copy made outside the clock.
            copies = [base[:n].clone() for _ in range(reps + 1)]
            step = functools.partial(_sample_fresh, sampler, rids, copies)
            best, median = _time_ms(step, reps)
            cells.append(f"{best:.1f} / {median:.1f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--sampler", action="store_true", help="also time Sampler.sample")
    parser.add_argument("--sampler-only", action="store_true", help="only time Sampler.sample")
    parser.add_argument(
        "--sampler-threads",
        type=int,
        default=None,
        help="Sampler(num_threads=...) for the sampler table",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {
        "fp32": [torch.float32],
        "bf16": [torch.bfloat16],
        "both": [torch.float32, torch.bfloat16],
    }[args.dtype]
    for dtype in dtypes if not args.sampler_only else []:
        bench_head(args.vocab, args.hidden, args.sizes, args.reps, dtype)
    if args.sampler or args.sampler_only:
        bench_sampler(args.vocab, args.sizes, args.reps, args.sampler_threads)


if __name__ == "__main__":
    main()
