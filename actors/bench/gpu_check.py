"""`bin/engine gpu-check`: prove the GPU runner on one device in a few minutes.

    bin/engine gpu-check [--dry-run] [--json out.json] [--batches 1 64 256] [--new-tokens 128]

On the GPU (Gemma 3 270M, bf16, the attention backend `model.attention = "auto"` picks):
  1. greedy parity against HF transformers on the same device: 10 prompts, one past the
     512-token sliding window; a prompt passes when our tokens equal HF's, or first differ
     where HF's raw logits for the two tokens are within `--tie-logits` (a bf16 near-tie);
  2. generation throughput at each batch size (64-token prompts, `--new-tokens` each,
     greedy, EOS ignored) through the whole engine, against HF `generate` on the same
     device and prompts;
  3. the engine stack against a bare loop over the model executor on the largest batch;
  4. batch-1 decode: bytes read per step (weights, the tied LM head once, the KV read) over
     the step time, as a fraction of the device's copy bandwidth (measured) and of its
     nominal peak where the device is known.
It prints one JSON object and exits 1 when a prompt fails parity (2 when there is no GPU).
`--dry-run` runs every step on the CPU in fp32 with small sizes: everything but the device
calls, so the script is known to work before a GPU is lent.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import anyio
import torch

from actors.app.config import EngineConfig
from actors.app.corpus import natural_text
from actors.bench.offline import run_bare, run_kvactor
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
WINDOW_PROMPT_TOKENS = 600  # past Gemma 3's 512-token sliding window


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def parity_prompts(tokenizer, count: int, long_len: int) -> list[list[int]]:
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    while len(ids) < long_len + 10:
        ids = ids + ids
    lengths = [8, 24, 40, 64, 96, 128, 160, 200, 256][: count - 1] + [long_len]
    step = max(1, (len(ids) - long_len) // count)
    return [[tokenizer.bos_id, *ids[i * step : i * step + n - 1]] for i, n in enumerate(lengths)]


def same_length_prompts(tokenizer, count: int, length: int, offset: int = 0) -> list[list[int]]:
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    while len(ids) < offset + count + length:
        ids = ids + ids
    return [[tokenizer.bos_id, *ids[offset + i : offset + i + length - 1]] for i in range(count)]


def load_hf(dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    from kernels.gguf_loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def hf_greedy(model, prompt: list[int], new_tokens: int, device: str):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,  # raw: min_new_tokens masks EOS in the processed scores
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [s[0].float().cpu() for s in out.logits]


def check_parity(ours: list[int], theirs: list[int], scores, tie: float) -> dict:
    matched = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
    entry = {"matched": matched, "of": len(theirs), "passed": matched == len(theirs)}
    if matched < len(theirs):
        step = scores[matched]
        gap = float(step[theirs[matched]] - step[ours[matched]])
        entry["first_diff_gap"] = round(gap, 4)
        entry["passed"] = gap <= tie
    return entry


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


def batch1_bandwidth(cfg, prompt: list[int], steps: int, device: str) -> dict:
    """Bytes read per batch-1 decode step over its time, through the bare executor."""
    from actors.bench.bare_executor import bare_executor
    from kernels.device import choose_attention
    from kernels.forward_batch import ForwardBatch
    from kernels.models import load_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config, model = load_model(None, dtype)
    model = model.to(device)
    elsize = torch.finfo(dtype).bits // 8
    weights = sum(p.numel() for p in model.parameters()) * elsize  # before any packing
    attention, _ = choose_attention(cfg.model.attention, device, dtype)
    executor = bare_executor(
        config,
        model,
        1,
        len(prompt) + steps + 8,
        attention=attention,
        cuda_graphs=cfg.model.cuda_graphs,
    )
    logits = executor.forward(ForwardBatch([0], [0], [prompt], [True]))
    token = int(logits[0].argmax())
    length = len(prompt)
    for _ in range(3):  # warm-up
        logits = executor.forward(ForwardBatch.decode([0], [length], [token]))
        token, length = int(logits[0].argmax()), length + 1
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        logits = executor.forward(ForwardBatch.decode([0], [length], [token]))
        token, length = int(logits[0].argmax()), length + 1
    sync(device)
    step_s = (time.perf_counter() - t) / steps
    kv_read = (length - steps // 2) * config.num_layers * 2 * config.num_kv_heads
    kv_read *= config.head_dim * elsize
    bytes_per_step = weights + kv_read
    achieved = bytes_per_step / step_s
    copy = copy_bandwidth(device, 1024 if device == "cuda" else 256)
    out = {
        "step_ms": round(step_s * 1e3, 3),
        "bytes_per_step": int(bytes_per_step),
        "achieved_gb_s": round(achieved / 1e9, 1),
        "copy_gb_s": round(copy / 1e9, 1),
        "fraction_of_copy": round(achieved / copy, 3),
    }
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        nominal = next((v for k, v in NOMINAL_BANDWIDTH.items() if k in name), None)
        out["device_name"] = name
        if nominal:
            out["nominal_gb_s"] = nominal / 1e9
            out["fraction_of_nominal"] = round(achieved / nominal, 3)
    return out


def engine_config(device: str, dtype: str, max_batch: int, context: int) -> EngineConfig:
    pages = max(256, max_batch * (context // 16 + 1) + 64)
    return EngineConfig.load(
        model__device=device,
        model__dtype=dtype,
        kv__page_size=16,
        kv__num_pages=pages,
        kv__context_len=context,
        kv__max_rows=max_batch + 8,
        scheduler__max_running_requests=max_batch,
        scheduler__max_batch_tokens=max(1024, max_batch * 2),
        sessions__max_sessions=0,
    )


def run(args) -> dict:
    t_start = time.perf_counter()
    from kernels.tokenizer_loader import load_tokenizer

    device = "cpu" if args.dry_run else "cuda"
    dtype_name = "float32" if args.dry_run else "bfloat16"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    tokenizer = load_tokenizer(None)
    max_batch = max(args.batches)
    cfg = engine_config(device, dtype_name, max_batch, context=1024)
    report: dict = {"device": device, "dry_run": args.dry_run, "dtype": dtype_name}

    # 1. parity
    prompts = parity_prompts(tokenizer, args.parity_prompts, WINDOW_PROMPT_TOKENS)
    hf = load_hf(dtype, device)
    greedy = GenerationParams(max_tokens=args.parity_tokens, temperature=0.0, ignore_eos=True)

    async def ours_parity():
        from actors.app.serving import ServingEngine

        async with ServingEngine(cfg) as eng:
            return await eng.generate_batch(prompts, greedy)

    results = anyio.run(ours_parity)
    # Each phase loads its own model: a collection after each lets the last one go before
    # the next loads (cycles in a stopped engine otherwise hold its weights; on a CPU dry
    # run five of them once reached 11 GB).
    gc.collect()
    per_prompt = []
    for prompt, result in zip(prompts, results):
        theirs, scores = hf_greedy(hf, prompt, args.parity_tokens, device)
        entry = check_parity(list(result.token_ids), theirs, scores, args.tie_logits)
        per_prompt.append({"prompt_tokens": len(prompt), **entry})
    report["parity"] = {
        "passed": all(p["passed"] for p in per_prompt),
        "new_tokens": args.parity_tokens,
        "per_prompt": per_prompt,
    }

    # 2. throughput against HF, 3. engine against the bare executor
    throughput = {}
    for batch in args.batches:
        group = same_length_prompts(tokenizer, batch, args.prompt_tokens)
        # Warm-up prompts of the same shape, other tokens: decode graphs are captured there.
        warm = same_length_prompts(tokenizer, batch, args.prompt_tokens, offset=3 * batch + 7)
        ours = anyio.run(run_kvactor, cfg, group, args.new_tokens, warm)
        gc.collect()
        theirs = hf_throughput(hf, group, args.new_tokens, device)
        throughput[str(batch)] = {
            "kvactor_tok_s": round(ours["output_tok_s"], 1),
            "hf_tok_s": round(theirs, 1),
            "ratio": round(ours["output_tok_s"] / theirs, 2),
        }
    report["throughput"] = throughput
    del hf
    gc.collect()
    group = same_length_prompts(tokenizer, max_batch, args.prompt_tokens)
    warm = same_length_prompts(tokenizer, max_batch, args.prompt_tokens, offset=3 * max_batch + 7)
    engine = anyio.run(run_kvactor, cfg, group, args.new_tokens, warm)["output_tok_s"]
    gc.collect()
    bare = run_bare(cfg, group, args.new_tokens)["output_tok_s"]
    gc.collect()
    report["engine_vs_bare"] = {
        "batch": max_batch,
        "engine_tok_s": round(engine, 1),
        "bare_tok_s": round(bare, 1),
        "ratio": round(engine / bare, 3),
    }

    # 4. batch-1 decode bandwidth
    report["batch1_bandwidth"] = batch1_bandwidth(cfg, group[0], args.bandwidth_steps, device)
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return report


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
    ap.add_argument("--tie-logits", type=float, default=0.5)
    args = ap.parse_args()
    small = args.dry_run
    args.batches = args.batches or ([1, 4] if small else [1, 64, 256])
    args.new_tokens = args.new_tokens or (8 if small else 128)
    args.parity_prompts = args.parity_prompts or (3 if small else 10)
    args.parity_tokens = args.parity_tokens or (8 if small else 32)
    args.bandwidth_steps = args.bandwidth_steps or (8 if small else 128)
    if not args.dry_run and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device; use --dry-run on a CPU machine"}))
        return 2
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if report["parity"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
