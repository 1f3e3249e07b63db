"""`bin/engine bench quality`: what a weight mode costs in accuracy, against exact fp32.

For each mode (`--modes fp32,fp16,bf16,int8,int4,gguf`: dtype, weight layout and
quantization of the runner; fp16 is an fp32 model with fp16 weights (`model.linear =
"fp16"`); bf16 has the weight layout `model.linear = "auto"` picks for it here; int8, int4
and gguf (a quantized GGUF kept as stored: what `model.quantization = "auto"` runs for one)
run in the dtype `model.dtype = auto` picks here, their products with the activation dtype
the runner's timing picks) it reports:

* perplexity of the model on a fixed English text (`--tokens` tokens in windows of
  `--window`, every position scored given the window before it; with `--llama-cpp-windows`
  as llama.cpp's `llama-perplexity -c WINDOW` scores: each window starts with BOS in place
  of its first token and only its second half is scored, so the two tools' figures compare);
* greedy agreement with fp32: over `--prompts` prompts, the share of the first
  `--new-tokens` greedy tokens equal to fp32's (teacher-free: each run generates on its
  own, so one early difference counts the rest as different), and how many prompts match
  exactly;
* decode speed at batch 1 (ms per token, best of a few).

The model executor runs directly (no engine), so the numbers are the weights' own.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from actors.app.corpus import natural_text
from actors.bench.timing import time_calls


def build(mode: str, path: str | None, rows: int, capacity: int):
    from actors.bench.bare_executor import bare_executor
    from kernels.cpu import choose_dtype
    from kernels.models import PLAN_KINDS, load_for

    if mode in PLAN_KINDS:  # int8, int4, gguf: in the dtype the runner's auto picks here
        dtype, _ = choose_dtype("auto")
    else:
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    # as the runner loads it: the activation dtype its timing picks for each kind
    quantization = mode if mode in PLAN_KINDS else "none"
    config, model, head, _, why = load_for(path, dtype, quantization, require_faster=False)
    if mode == "fp16":
        return bare_executor(config, model, rows, capacity, validate=False, linear="fp16")
    if mode == "bf16":  # the layout the runner's model.linear = auto picks for bf16 here
        return bare_executor(config, model, rows, capacity, validate=False, linear="auto")
    if head is not None:
        print(f"{mode}: {why}", flush=True)
    return bare_executor(config, model, rows, capacity, lm_head=head, validate=False)


def perplexity(
    executor, ids: list[int], window: int, llama_cpp: bool = False, bos: int | None = None
) -> float:
    """exp(mean negative log-likelihood); `llama_cpp`: windows of exactly `window` tokens,
    each opened by `bos`, scored on their second half only (llama.cpp's perplexity tool)."""
    from kernels.forward_batch import ForwardBatch
    from kernels.logprobs import token_logprobs

    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + (0 if llama_cpp else 1)]
        if len(chunk) < (window if llama_cpp else 2):
            break
        if llama_cpp:
            chunk = [bos, *chunk[1:]]
        inputs, targets = chunk[:-1], chunk[1:]
        batch = ForwardBatch([0], [0], [inputs], [True])
        _, (logits,) = executor.forward_full(batch, [True])
        lps, _, _, _ = token_logprobs(logits, targets, 0)
        if llama_cpp:
            lps = lps[window // 2 :]  # the targets at positions window/2 + 1 .. window - 1
        total += sum(lps)
        count += len(lps)
    return math.exp(-total / count)


def greedy(executor, prompt: list[int], n: int) -> list[int]:
    from kernels.forward_batch import ForwardBatch

    logits = executor.forward(ForwardBatch([0], [0], [prompt], [True]))
    out = [int(logits[0].argmax())]
    pos = len(prompt)
    for _ in range(n - 1):
        logits = executor.forward(ForwardBatch.decode([0], [pos], [out[-1]]))
        out.append(int(logits[0].argmax()))
        pos += 1
    return out


def decode_ms(executor, prompt: list[int]) -> float:
    from kernels.forward_batch import ForwardBatch

    executor.forward(ForwardBatch([0], [0], [prompt], [True]))
    step = ForwardBatch.decode([0], [len(prompt)], [prompt[-1]])
    return time_calls(lambda: executor.forward(step), repeats=10, warmup=2).best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="bin/engine bench quality", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--modes", default="fp32,fp16,bf16,int8,int4")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument(
        "--llama-cpp-windows",
        action="store_true",
        help="score as llama.cpp's llama-perplexity -c WINDOW does (BOS-led windows, 2nd half)",
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    from kernels.cpu import bf16_matmul_supported, choose_threads
    from kernels.tokenizer_loader import load_tokenizer

    torch.set_num_threads(choose_threads(args.threads, own_process=True)[0])
    tok = load_tokenizer(args.model)
    ids = tok.encode(natural_text(), add_special_tokens=False)
    while len(ids) < args.tokens:
        ids = ids + ids
    ids = [tok.bos_id, *ids[: args.tokens - 1]]
    step = max(1, (len(ids) - 64) // args.prompts)
    prompts = [[tok.bos_id, *ids[1 + i * step : 1 + i * step + 40]] for i in range(args.prompts)]
    reference = None
    for mode in args.modes.split(","):
        if mode == "bf16" and not bf16_matmul_supported():
            print(f"{mode}: skipped (this CPU cannot run bf16 matmuls)")
            continue
        t = time.perf_counter()
        executor = build(mode, args.model, 1, max(args.window + 2, 48 + args.new_tokens))
        load_s = time.perf_counter() - t
        with torch.inference_mode():
            ppl = perplexity(executor, ids, args.window, args.llama_cpp_windows, tok.bos_id)
            outs = [greedy(executor, p, args.new_tokens) for p in prompts]
            ms = decode_ms(executor, prompts[0])
        if reference is None:
            reference = outs
        same = sum(a == b for o, r in zip(outs, reference) for a, b in zip(o, r))
        exact = sum(o == r for o, r in zip(outs, reference))
        print(
            f"{mode}: perplexity {ppl:.3f} on {len(ids)} tokens | greedy tokens equal to "
            f"{args.modes.split(',')[0]}: {same / (len(outs) * args.new_tokens):.1%}, "
            f"{exact}/{len(outs)} prompts exactly | batch-1 decode {ms:.1f} ms/token "
            f"({1000 / ms:.1f} tok/s) | load {load_s:.1f} s",
            flush=True,
        )
        del executor
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
