"""`bin/engine gpu-check`: prove the GPU runner on one device in a few minutes.

    bin/engine gpu-check [--random-weights] [--dry-run] [--json out.json]
                         [--attention auto|triton|flashinfer] [--require flashinfer,cuda-graphs]
                         [--batches 1 64 256] [--tp-ranks 2]

On the GPU machine without network, `bin/gpu-device-check` runs it with that machine's own
python3 after staging the carried wheelhouse (docs/operations.md, "The GPU check").

The model: the embedded Gemma 3 270M GGUF, or with `--random-weights` a model of the same
shapes with seeded random weights written once as safetensors (`actors/bench/random_model`),
so nothing has to be carried. Steps, in bf16 on CUDA:
  0. the attention backend `auto` picks, and with FlashInfer installed its kernels warmed
     (compiled on a fresh machine) in a step of their own, timed;
  1. parity by logprobs at every generated step: each prompt (several past the 512-token
     sliding window) is generated greedily by the engine (`model.linear = aten`), once per
     attention backend available (Triton, FlashInfer; `--attention` keeps one) and KV pool
     layout (one pool; a separate sliding-window pool); HF transformers scores the same
     tokens teacher-forced on the same device, in fp32 (the reference) and in the engine's
     dtype (HF's own rounding error there). A run passes when the engine's logprob of each
     token, and its choice against the reference's best token, are within
     `max(--logprob-tol, 2 x HF's own error)`;
  1b. tensor parallelism (`--tp-ranks`, default 2 on CUDA): the same prompts in fp32 with
     the model split over that many ranks, one GPU each with NCCL between them (gloo on the
     CPU), against one rank: the same tokens and logprobs within 1e-3. Skipped, saying so,
     on a machine with fewer GPUs than ranks;
  2. generation throughput at each batch size (64-token prompts, `--new-tokens` each,
     greedy, EOS ignored) through one engine for every batch, against HF `generate`;
  3. the engine stack against a bare loop over the model executor on the largest batch;
  4. batch-1 decode through the bare executor: bytes read per step over the step time as a
     fraction of the device's copy bandwidth (measured) and nominal peak; the decode graphs
     captured and replayed; and the synchronising CUDA calls per decode step (torch's sync
     debug mode).
It prints one JSON object and exits 1 when parity (or the split's) fails or a `--require`d
feature (`flashinfer`, `cuda-graphs`, `tensor-parallel`) was not used, 2 when there is no GPU.
`--dry-run` runs every step on the CPU in fp32 with small sizes (the split only with
`--tp-ranks 2`), so the script is known to work before a GPU is lent.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import anyio
import torch

from actors.app.config import EngineConfig
from actors.app.corpus import natural_text
from actors.bench.offline import run_bare, timed_batch
from transport.messages.params import GenerationParams

# Nominal HBM bandwidth (bytes/s) by device-name fragment, for the report only.
NOMINAL_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.04e12,
    "A100": 1.94e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10": 0.6e12,
    "RTX 4090": 1.01e12,
}
WINDOW = 512  # Gemma 3's sliding window: the parity prompts past it start at 600 tokens
REQUIREMENTS = ("flashinfer", "cuda-graphs", "tensor-parallel")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parity_prompts(tokenizer, count: int, past_window: int) -> list[list[int]]:
    """`count` prompts of growing length, the last `past_window` of them longer than the
    sliding window (600, 800, 1000, ... tokens)."""
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    short = [8, 24, 40, 64, 96, 128, 160, 200, 256][: count - past_window]
    lengths = short + [600 + 200 * i for i in range(past_window)]
    while len(ids) < max(lengths) + count * 16:
        ids = ids + ids
    return [[tokenizer.bos_id, *ids[i * 16 : i * 16 + n - 1]] for i, n in enumerate(lengths)]


def same_length_prompts(tokenizer, count: int, length: int, offset: int = 0) -> list[list[int]]:
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    while len(ids) < offset + count + length:
        ids = ids + ids
    return [[tokenizer.bos_id, *ids[offset + i : offset + i + length - 1]] for i in range(count)]


def load_hf(model_path, dtype: torch.dtype, device: str):
    """HF transformers' model of `model_path` (a HF folder), or of the embedded GGUF."""
    from transformers import AutoModelForCausalLM

    from kernels.gguf_loader import default_model_path

    if model_path is not None:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    else:
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    return model.to(device).eval()


def teacher_forced_logprobs(model, prompt: list[int], tokens: list[int], device: str):
    """float32 log-softmax [len(tokens), vocab]: row i is the distribution `model` gives
    tokens[i] after prompt + tokens[:i] (one forward over the whole sequence)."""
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 :]
    return logits.float().log_softmax(-1).cpu()


def logprob_errors(ours: list[float], tokens: list[int], reference, other) -> dict:
    """Per generated step: |our logprob - the reference's| of our token, how far our token
    is below the reference's best (0 when we chose its argmax), and HF-in-our-dtype's own
    |logprob - the reference's| (the rounding error that dtype brings by itself)."""
    idx = torch.arange(len(tokens))
    picked = torch.tensor(tokens)
    ref = reference[idx, picked]
    ours_t = torch.tensor(ours, dtype=torch.float32)
    own = (other[idx, picked] - ref).abs() if other is not None else torch.zeros(len(tokens))
    return {
        "tokens": len(tokens),
        "max_logprob_err": round(float((ours_t - ref).abs().max()), 5),
        "mean_logprob_err": round(float((ours_t - ref).abs().mean()), 5),
        "max_gap_to_best": round(float((reference.max(-1).values - ref).max()), 5),
        "agree_with_best": round(float((reference.argmax(-1) == picked).float().mean()), 4),
        "hf_own_max_err": round(float(own.max()), 5),
    }


def hf_throughput(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False)
        sync(device)
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        sync(device)
    return len(prompts) * new_tokens / (time.perf_counter() - t)


def copy_bandwidth(device: str, megabytes: int) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 5
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * reps / (time.perf_counter() - t)


def batch1_decode(cfg, model_path, prompt: list[int], steps: int, device: str) -> dict:
    """Batch-1 decode through the bare executor with the engine's backend and graphs: bytes
    read per step over its time, the graphs replayed, and synchronising calls per step."""
    from actors.bench.bare_executor import bare_executor
    from kernels.device import choose_attention
    from kernels.forward_batch import ForwardBatch
    from kernels.models import load_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config, model = load_model(model_path, dtype)
    model = model.to(device)
    elsize = torch.finfo(dtype).bits // 8
    weights = sum(p.numel() for p in model.parameters()) * elsize  # before any packing
    attention, _ = choose_attention(cfg.model.attention, device, dtype)
    executor = bare_executor(
        config,
        model,
        1,
        len(prompt) + 2 * steps + 32,
        validate=False,
        attention=attention,
        cuda_graphs=cfg.model.cuda_graphs,
    )
    logits = executor.forward(ForwardBatch([0], [0], [prompt], [True]))
    token, length = int(logits[0].argmax()), len(prompt)

    def step() -> None:
        nonlocal logits, token, length
        logits = executor.forward(ForwardBatch.decode([0], [length], [token]))
        token, length = int(logits[0].argmax()), length + 1

    for _ in range(3):  # warm-up (captures the batch-1 graph)
        step()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    step_s = (time.perf_counter() - t) / steps
    out = {"attention": attention, "step_ms": round(step_s * 1e3, 3)}
    graphs = executor.graphs
    out["graph_buckets"] = graphs.captured_buckets if graphs is not None else []
    out["graph_replays"] = graphs.replays if graphs is not None else 0
    if device == "cuda":

        def forward_only() -> None:  # the step without reading its token back
            nonlocal length
            executor.forward(ForwardBatch.decode([0], [length], [token]))
            length += 1

        out["syncs_per_step"] = syncs_per_call(forward_only)
    kv_read = (length - steps // 2) * config.num_layers * 2 * config.num_kv_heads
    kv_read *= config.head_dim * elsize
    bytes_per_step = weights + kv_read
    achieved = bytes_per_step / step_s
    copy = copy_bandwidth(device, 1024 if device == "cuda" else 256)
    out.update(
        bytes_per_step=int(bytes_per_step),
        achieved_gb_s=round(achieved / 1e9, 1),
        copy_gb_s=round(copy / 1e9, 1),
        fraction_of_copy=round(achieved / copy, 3),
    )
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        nominal = next((v for k, v in NOMINAL_BANDWIDTH.items() if k in name), None)
        if nominal:
            out["nominal_gb_s"] = nominal / 1e9
            out["fraction_of_nominal"] = round(achieved / nominal, 3)
    return out


def syncs_per_call(fn, calls: int = 4) -> float:
    """Synchronising CUDA calls per call of `fn` (torch's sync debug mode warns on each: a
    blocking copy, an `.item()`, a stream synchronise)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found = [w for w in caught if "synchroniz" in str(w.message)]
    return round(len(found) / calls, 2)


def engine_config(
    device: str,
    dtype: str,
    max_batch: int,
    context: int,
    model_path=None,
    attention: str = "auto",
    swa_num_pages: int = -1,
    ranks: int = 1,
) -> EngineConfig:
    """`swa_num_pages`: 0 puts the sliding layers' KV in the one pool, -1 in a pool of their own;
    `ranks`: the model split over that many tensor-parallel ranks."""
    pages = max(256, max_batch * (context // 16 + 1) + 64)
    return EngineConfig.load(
        parallel__tensor_parallel_size=ranks,
        model__path=str(model_path or ""),
        model__device=device,
        model__dtype=dtype,
        model__attention=attention,
        model__linear="aten",  # the exact path (on the CPU, auto may pick fp16 weights)
        kv__page_size=16,
        kv__num_pages=pages,
        kv__swa_num_pages=swa_num_pages,
        kv__context_len=context,
        kv__max_rows=max_batch + 8,
        kv__radix=False,  # every timed prompt is prefilled in full
        scheduler__max_running_requests=max_batch,
        scheduler__max_batch_tokens=max(1024, max_batch * 2),
        sessions__max_sessions=0,
    )


def attention_backends(device: str, dtype: torch.dtype) -> list[str]:
    """Every backend this machine can run for `dtype` (parity runs on each)."""
    if device == "cpu":
        return ["torch"]
    names = ["triton"]
    if dtype != torch.float32 and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


def warm_flashinfer(config, dtype: torch.dtype) -> float:
    """Seconds to build FlashInfer's kernels for this model (its JIT on a fresh machine)."""
    from kernels.attention import AttentionShape
    from kernels.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend("cuda", dtype).warm(AttentionShape.of(config), page_size=16)


def parity(args, model_path, prompts, device, dtype, backends) -> dict:
    """Greedy generation with logprobs per backend and pool layout, against HF (module doc)."""
    reference = load_hf(model_path, torch.float32, device)
    same = None if dtype == torch.float32 else load_hf(model_path, dtype, device)
    params = GenerationParams(
        max_tokens=args.parity_tokens, temperature=0.0, ignore_eos=True, logprobs=True
    )
    runs, hf_cache = {}, {}
    for backend in backends:
        for layout, swa_pages in (("one_pool", 0), ("sliding_pool", -1)):
            cfg = engine_config(
                device, args.dtype_name, len(prompts), args.context, model_path, backend, swa_pages
            )
            results = anyio.run(_generate, cfg, prompts, params)
            gc.collect()
            per_prompt = []
            for prompt, result in zip(prompts, results):
                tokens = list(result.token_ids)
                if len(tokens) < args.parity_tokens:  # ignore_eos: always the full count
                    per_prompt.append({"tokens": len(tokens), "error": "output too short"})
                    continue
                key = (tuple(prompt), tuple(tokens))
                if key not in hf_cache:  # backends that agree share HF's forwards
                    ref = teacher_forced_logprobs(reference, prompt, tokens, device)
                    own = same and teacher_forced_logprobs(same, prompt, tokens, device)
                    hf_cache[key] = (ref, own)
                ours = [lp.logprob for lp in result.logprobs]
                errors = logprob_errors(ours, tokens, *hf_cache[key])
                per_prompt.append({"prompt_tokens": len(prompt), **errors})
            runs[f"{backend}/{layout}"] = per_prompt
    del reference, same
    gc.collect()
    valid = [p for run in runs.values() for p in run if "error" not in p]
    own = max((p["hf_own_max_err"] for p in valid), default=0.0)
    tol = max(args.logprob_tol, 2 * own)
    for name, per_prompt in runs.items():
        for p in per_prompt:
            p["passed"] = (
                "error" not in p and max(p["max_logprob_err"], p["max_gap_to_best"]) <= tol
            )
        runs[name] = {"passed": all(p["passed"] for p in per_prompt), "per_prompt": per_prompt}
    return {
        "passed": all(r["passed"] for r in runs.values()),
        "new_tokens": args.parity_tokens,
        "tolerance": round(tol, 5),
        "hf_own_max_err": own,
        "window_prompts": sum(len(p) > WINDOW for p in prompts),
        "runs": runs,
    }


def tensor_parallel(args, model_path, prompts, device) -> dict:
    """Greedy generation with logprobs, fp32, the model split over `--tp-ranks` ranks (one GPU
    each, NCCL; gloo on the CPU) against one rank: the same tokens, logprobs within 1e-3.
    Skipped, saying why, where the machine has fewer GPUs than ranks."""
    ranks = args.tp_ranks
    if device == "cuda" and torch.cuda.device_count() < ranks:
        return {"skipped": f"{ranks} ranks need {ranks} GPUs; {torch.cuda.device_count()} seen"}
    params = GenerationParams(
        max_tokens=args.parity_tokens, temperature=0.0, ignore_eos=True, logprobs=True
    )
    attention = "triton" if device == "cuda" else "torch"  # fp32 kernels
    runs = {}
    for n in (1, ranks):
        cfg = engine_config(
            device, "float32", len(prompts), args.context, model_path, attention, ranks=n
        )
        start = time.perf_counter()
        try:
            results = anyio.run(_generate, cfg, prompts, params)
        except Exception as exc:  # in the report, as a failed step, not a traceback
            return {"passed": False, "ranks": ranks, "error": f"{n} rank(s): {exc!r}"[:2000]}
        runs[n] = (results, time.perf_counter() - start)
        gc.collect()
    whole, split = runs[1][0], runs[ranks][0]
    same_tokens = [list(a.token_ids) == list(b.token_ids) for a, b in zip(whole, split)]
    err = max(
        (
            abs(x.logprob - y.logprob)
            for a, b in zip(whole, split)
            for x, y in zip(a.logprobs, b.logprobs)
        ),
        default=float("inf"),  # no tokens to compare: not a pass
    )
    return {
        "passed": all(same_tokens) and err <= 1e-3,
        "ranks": ranks,
        "data_group": "nccl" if device == "cuda" else "gloo",
        "same_tokens": same_tokens,
        "max_logprob_diff": err,
        "seconds": {str(n): round(t, 2) for n, (_, t) in runs.items()},
    }


async def _generate(cfg, prompts, params):
    from actors.app.serving import ServingEngine

    async with ServingEngine(cfg) as eng:
        return await eng.generate_batch(prompts, params)


async def _throughput(cfg, groups: dict[int, tuple], new_tokens: int) -> dict[int, dict]:
    """One engine for every batch size (groups: batch -> (prompts, warm-up prompts))."""
    from actors.app.serving import ServingEngine

    async with ServingEngine(cfg) as eng:
        return {b: await timed_batch(eng, g, new_tokens, w) for b, (g, w) in groups.items()}


def throughput(args, model_path, tokenizer, device, dtype) -> tuple[dict, dict]:
    max_batch = max(args.batches)
    cfg = engine_config(
        device, args.dtype_name, max_batch, args.context, model_path, args.attention
    )
    groups, offset = {}, 0
    for batch in args.batches:  # disjoint prompts: no prefix-cache hits between batches
        group = same_length_prompts(tokenizer, batch, args.prompt_tokens, offset)
        warm = same_length_prompts(tokenizer, batch, args.prompt_tokens, offset + 2 * batch + 7)
        groups[batch] = (group, warm)
        offset += 4 * batch + 16
    ours = anyio.run(_throughput, cfg, groups, args.new_tokens)
    gc.collect()
    hf = load_hf(model_path, dtype, device)
    out = {}
    for batch, (group, _) in groups.items():
        theirs = hf_throughput(hf, group, args.new_tokens, device)
        mine = ours[batch]
        out[str(batch)] = {
            "kvactor_tok_s": round(mine["output_tok_s"], 1),
            "hf_tok_s": round(theirs, 1),
            "ratio": round(mine["output_tok_s"] / theirs, 2),
            # where the engine's time went: the runner's share of the wall time, and the
            # mean time per step outside the runner (scheduling, messages, detokenizing)
            "steps": mine["steps"],
            "runner_busy_share": round(mine["runner_busy_share"], 3),
            "gap_ms_per_step": round(mine["gap_ms"], 2),
        }
    del hf
    gc.collect()
    bare = run_bare(cfg, groups[max_batch][0], args.new_tokens)["output_tok_s"]
    gc.collect()
    engine = ours[max_batch]["output_tok_s"]
    versus = {
        "batch": max_batch,
        "engine_tok_s": round(engine, 1),
        "bare_tok_s": round(bare, 1),
        "ratio": round(engine / bare, 3),
    }
    return out, versus


def run(args) -> dict:
    t_start = time.perf_counter()
    from actors.bench.random_model import random_gemma3_folder
    from kernels.device import choose_attention
    from kernels.models import load_config
    from kernels.tokenizer_loader import load_tokenizer

    device = "cpu" if args.dry_run else "cuda"
    args.dtype_name = "float32" if args.dry_run else "bfloat16"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    model_path = random_gemma3_folder(args.work_dir, args.seed) if args.random_weights else None
    tokenizer = load_tokenizer(model_path)
    report: dict = {
        "device": device,
        "dry_run": args.dry_run,
        "dtype": args.dtype_name,
        "model": f"random weights, seed {args.seed}" if model_path else "embedded GGUF",
        "torch": torch.__version__,
    }
    if device == "cuda":
        report["device_name"] = torch.cuda.get_device_name(0)
    backends = attention_backends(device, dtype)
    if args.attention != "auto":
        if args.attention not in backends:
            raise SystemExit(f"--attention {args.attention}: this machine runs {backends}")
        backends = [args.attention]
    engine, why = choose_attention(args.attention, device, dtype)
    report["attention"] = {"engine": engine, "why": why, "parity_on": backends}
    if "flashinfer" in backends:
        report["flashinfer_warm_s"] = round(warm_flashinfer(load_config(model_path), dtype), 1)
    report["setup_s"] = round(time.perf_counter() - t_start, 1)
    save(args, report)

    prompts = parity_prompts(tokenizer, args.parity_prompts, args.window_prompts)
    report["parity"] = parity(args, model_path, prompts, device, dtype, backends)
    save(args, report)
    if args.tp_ranks > 1:
        report["tensor_parallel"] = tensor_parallel(args, model_path, prompts, device)
        save(args, report)
    report["throughput"], report["engine_vs_bare"] = throughput(
        args, model_path, tokenizer, device, dtype
    )
    save(args, report)
    group = same_length_prompts(tokenizer, 1, args.prompt_tokens, offset=999)
    cfg = engine_config(device, args.dtype_name, 1, args.context, model_path, args.attention)
    report["batch1"] = batch1_decode(cfg, model_path, group[0], args.bandwidth_steps, device)
    report["unmet_requirements"] = unmet(args.require, report)
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return report


def save(args, report: dict) -> None:
    """The report so far to `--json` (what a run cut short by a time limit still leaves)."""
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def unmet(required: list[str], report: dict) -> list[str]:
    """The `--require`d features this run did not use, each with what it used instead."""
    out = []
    if "flashinfer" in required and report["attention"]["engine"] != "flashinfer":
        out.append(f"flashinfer: the engine ran {report['attention']['engine']}")
    if "cuda-graphs" in required and not report["batch1"].get("graph_replays"):
        out.append("cuda-graphs: no decode step replayed a graph")
    tp = report.get("tensor_parallel", {"skipped": "--tp-ranks 1"})
    if "tensor-parallel" in required and "skipped" in tp:
        out.append(f"tensor-parallel: skipped ({tp['skipped']})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="bin/engine gpu-check", description=__doc__)
    ap.add_argument("--dry-run", action="store_true", help="everything on the CPU, small")
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--parity-prompts", type=int)
    ap.add_argument("--parity-tokens", type=int)
    ap.add_argument("--bandwidth-steps", type=int)
    ap.add_argument("--random-weights", action="store_true", help="a seeded random model")
    ap.add_argument("--seed", type=int, default=0, help="of the random weights")
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "kvactor"))
    ap.add_argument("--logprob-tol", type=float, help="default 0.05 (bf16), 1e-3 (fp32)")
    ap.add_argument("--attention", default="auto", help="auto (every backend), triton, ...")
    ap.add_argument(
        "--require", default="", help="comma list: flashinfer,cuda-graphs,tensor-parallel"
    )
    ap.add_argument(
        "--tp-ranks",
        type=int,
        help="split the model over N ranks against one (default 2 on CUDA, 1: off, on the CPU)",
    )
    args = ap.parse_args()
    args.require = [r for r in args.require.split(",") if r]
    bad = sorted(set(args.require) - set(REQUIREMENTS))
    if bad:
        ap.error(f"--require takes {', '.join(REQUIREMENTS)}; got {', '.join(bad)}")
    small = args.dry_run
    args.batches = args.batches or ([1, 4] if small else [1, 64, 256])
    args.new_tokens = args.new_tokens or (8 if small else 128)
    args.parity_prompts = args.parity_prompts or (3 if small else 10)
    args.parity_tokens = args.parity_tokens or (8 if small else 32)
    args.bandwidth_steps = args.bandwidth_steps or (8 if small else 128)
    args.logprob_tol = args.logprob_tol or (1e-3 if small else 0.05)
    args.window_prompts = 1 if small else 3
    args.tp_ranks = args.tp_ranks or (1 if small else 2)
    args.context = 1024 if small else 2048
    if not args.dry_run and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device; use --dry-run on a CPU machine"}))
        return 2
    report = run(args)
    print(json.dumps(report, indent=2))
    save(args, report)
    passed = report["parity"]["passed"] and report.get("tensor_parallel", {}).get("passed", True)
    return 0 if passed and not report["unmet_requirements"] else 1


if __name__ == "__main__":
    sys.exit(main())
