"""`bin/engine bench model`: prefill and decode speed of our executor vs HF transformers.

Prints prefill tokens/s on a 512-token prompt, decode step time at batch 1, 8 and 32 with a
realistic context (128 tokens each by default), the share of a decode step spent in the LM
head, and the same prefill/decode figures for HF transformers (same process, same prompts,
fp32). Each figure is the best of `--repeats` timed runs after one warm-up run (the dev
machine is shared; the best run is the least disturbed one). Before the timings it prints
the bytes the loaded weights hold beside the model file's size, and the peak RSS so far;
`--quantization` loads the model as the runner does for that `model.quantization`;
`--compile` times each decode step through the compiled small-step graph and eagerly.

The floor of a decode step is its memory traffic: every weight is read once. Before the
timings it measures the machine's memory bandwidth (STREAM-like: a sum reading a buffer far
larger than the caches, and a copy, with torch's threads), and each batch's line gives the
step's floor (the bytes a step reads at that read bandwidth) as a share of the measured step.
"""

from __future__ import annotations

import argparse
import time

import torch

from actors.bench.bare_executor import bare_executor
from actors.bench.timing import time_calls
from kernels.config import ModelConfig
from kernels.forward_batch import ForwardBatch
from kernels.models import resolve_model_source


def _prompts(config: ModelConfig, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ordinary (non-special) token ids; content does not change the arithmetic.
    low = min(1000, config.vocab // 4)  # a tiny test vocabulary has fewer than 1000 tokens
    ids = torch.randint(low, min(config.vocab, 200_000), (count, length), generator=gen)
    return [[config.bos_id or 2] + row.tolist()[1:] for row in ids]


class _OurEngine:
    """Executor + contiguous slots per row, reset between measurements."""

    def __init__(
        self,
        config: ModelConfig,
        model: torch.nn.Module,
        rows: int,
        capacity: int,
        linear: str = "aten",
        lm_head=None,
    ):
        self.rows, self.capacity = rows, capacity
        self.executor = bare_executor(config, model, rows, capacity, lm_head=lm_head, linear=linear)

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        n = len(prompts)
        return self.executor.forward(ForwardBatch(list(range(n)), [0] * n, prompts, [True] * n))

    def decode_step(self, lens: list[int], tokens: list[int]) -> torch.Tensor:
        rows = list(range(len(lens)))
        return self.executor.forward(ForwardBatch.decode(rows, lens, tokens))


BANDWIDTH_BUFFER_MIB = 512  # far past any last-level cache


def memory_bandwidth(repeats: int, mib: int = BANDWIDTH_BUFFER_MIB) -> tuple[float, float]:
    """(read, copy) bandwidth in GB/s with torch's threads: a float32 sum over `mib` MiB (bytes
    read), and a copy of it (bytes read plus bytes written, as STREAM counts them)."""
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    read = time_calls(lambda: source.sum(), repeats).best
    copy = time_calls(lambda: target.copy_(source), repeats).best
    return source.nbytes / read / 1e9, 2 * source.nbytes / copy / 1e9


def step_read_bytes(model: torch.nn.Module, head) -> int:
    """Weight bytes a batch-1 decode step reads: every decoder layer's as loaded (packed,
    quantized or plain) and the LM head's in the form its batch-1 backend reads (the
    embedding table is gathered a row at a time, so it is not counted)."""
    from kernels.linear import NarrowFp16Linear, Q8_0NarrowLinear
    from kernels.memory_plan import measured_weight_bytes

    layers = sum(measured_weight_bytes(layer) for layer in model.layers)
    # two copies (onednn+fp16's, or Q8_0 blocks beside a wide layout): a narrow step reads
    # the fp16 copy or the blocks only
    narrow = (NarrowFp16Linear, Q8_0NarrowLinear)
    layers -= sum(m.wide.weight_bytes for m in model.layers.modules() if isinstance(m, narrow))
    backend = head.backend_for(1)
    if backend == "fp16":
        head_bytes = head.vocab_size * head.hidden_size * 2
    elif backend in ("int8", "int4", "q8_0"):
        blocks = head._q8_0 if backend == "q8_0" else head._quantized
        head_bytes = sum(t.numel() * t.element_size() for t in blocks.tensors)
    else:  # aten, onednn, numpy: the weight's own dtype
        head_bytes = head.vocab_size * head.hidden_size * head.weight.element_size()
    return layers + head_bytes


def bench_ours(config, model, args, lm_head=None) -> dict[str, float]:
    results: dict[str, float] = {}
    engine = _OurEngine(
        config,
        model,
        max(args.batches),
        max(args.prefill_len, args.context + 64),
        "aten" if lm_head is not None else args.linear,
        lm_head,
    )
    print(f"linear layout {engine.executor.linear}: {engine.executor.linear_reason}")
    read_bytes = step_read_bytes(model, engine.executor.lm_head)
    results["step_read_mb"] = read_bytes / 1e6
    if args.read_gb_s:
        results["floor_ms"] = read_bytes / (args.read_gb_s * 1e9) * 1000
        print(
            f"a decode step reads {read_bytes / 1e6:.0f} MB of weights: "
            f"{results['floor_ms']:.1f} ms at {args.read_gb_s:.1f} GB/s",
            flush=True,
        )
    prompt = _prompts(config, 1, args.prefill_len, seed=0)
    seconds = time_calls(lambda: engine.prefill(prompt), args.repeats).best
    results["prefill_tok_s"] = args.prefill_len / seconds
    compiled = None
    if args.compile:
        from kernels.compiled_step import CompiledStep

        compiled = engine.executor.compiled = CompiledStep(engine.executor)
        compiled.compile()
        if not compiled.ready:
            raise SystemExit(f"compile failed: {compiled.failed}")
        results["compile_s"] = compiled.compile_s
        print(f"compiled the small-step graphs in {compiled.compile_s:.1f} s", flush=True)
    for batch in args.batches:
        prompts = _prompts(config, batch, args.context, seed=batch)
        engine.prefill(prompts)
        lens = [args.context] * batch
        tokens = [p[-1] for p in prompts]
        # Re-decoding at the same position overwrites the same slot: a steady-state step.
        if compiled is not None:  # the same step eagerly, for the ratio
            limit, compiled.max_tokens = compiled.max_tokens, 0
            eager = time_calls(lambda: engine.decode_step(lens, tokens), args.repeats).best
            compiled.max_tokens = limit
            results[f"decode_b{batch}_eager_ms"] = eager * 1000
        step = time_calls(lambda: engine.decode_step(lens, tokens), args.repeats).best
        hidden = torch.randn(batch, config.hidden, dtype=model.embed_tokens.weight.dtype)
        head = time_calls(lambda: engine.executor.lm_head(hidden), args.repeats).best
        results[f"decode_b{batch}_ms"] = step * 1000
        results[f"decode_b{batch}_tok_s"] = batch / step
        results[f"lm_head_b{batch}_share"] = head / step
        if args.profile:
            from actors.bench.step_profile import format_profile, profile_steps

            ms = profile_steps(
                lambda: engine.decode_step(lens, tokens), engine.executor, args.repeats
            )
            print(format_profile(f"batch {batch}", ms), flush=True)
    return results


def bench_hf(args) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    kind, source = resolve_model_source(args.model)
    if kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    hf.eval()
    config = _config_for_prompts(args)
    results: dict[str, float] = {}
    prompt = torch.tensor(_prompts(config, 1, args.prefill_len, seed=0))
    with torch.inference_mode():
        seconds = time_calls(lambda: hf(prompt, logits_to_keep=1), args.repeats).best
        results["prefill_tok_s"] = args.prefill_len / seconds
        for batch in args.batches:
            ids = torch.tensor(_prompts(config, batch, args.context, seed=batch))
            cache = DynamicCache(config=hf.config)
            hf(ids, cache=cache, use_cache=True, logits_to_keep=1)
            step_ids = ids[:, -1:]

            def step() -> None:
                hf(step_ids, cache=cache, use_cache=True)
                cache.crop(-1)  # drop the step's token: the context length stays steady

            seconds = time_calls(step, args.repeats).best
            results[f"decode_b{batch}_ms"] = seconds * 1000
            results[f"decode_b{batch}_tok_s"] = batch / seconds
    return results


_CONFIG: ModelConfig | None = None


def _config_for_prompts(args) -> ModelConfig:
    global _CONFIG
    if _CONFIG is None:
        from kernels.models import load_config

        _CONFIG = load_config(args.model)
    return _CONFIG


def _print(label: str, results: dict[str, float], args) -> None:
    print(
        f"[{label}] prefill {results['prefill_tok_s']:.1f} tok/s ({args.prefill_len}-token "
        "prompt, last-token logits)"
    )
    for b in args.batches:
        line = (
            f"[{label}] decode batch {b:>2} (context {args.context}): "
            f"{results[f'decode_b{b}_ms']:.1f} ms/step, "
            f"{results[f'decode_b{b}_tok_s']:.1f} tok/s"
        )
        if f"lm_head_b{b}_share" in results:
            line += f", lm_head {100 * results[f'lm_head_b{b}_share']:.0f}% of the step"
        if "floor_ms" in results:
            share = results["floor_ms"] / results[f"decode_b{b}_ms"]
            line += f", weight-read floor {100 * share:.0f}% of the step"
        if f"decode_b{b}_eager_ms" in results:
            line += f" (compiled; eager {results[f'decode_b{b}_eager_ms']:.1f} ms/step)"
        print(line, flush=True)


def _load(args, dtype):
    """(config, model, lm_head or None, quantization label) as the runner loads them."""
    from kernels.models import load_for

    config, model, lm_head, mode, why = load_for(
        args.model, dtype, args.quantization, require_faster=False
    )
    if mode != "none":
        print(f"quantization {mode}: {why}", flush=True)
    return config, model, lm_head, "" if mode == "none" else mode


def _print_memory(args, model, lm_head) -> None:
    """The loaded weights' bytes beside the model file's, and the process's peak RSS."""
    import resource

    from kernels.memory_plan import measured_weight_bytes

    _, source = resolve_model_source(args.model)
    files = [source] if source.is_file() else list(source.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    held = measured_weight_bytes(model, lm_head)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"weights in memory {held / 2**20:.1f} MiB (model files {on_disk / 2**20:.1f} MiB, "
        f"{held / on_disk:.2f}x); peak RSS so far {peak / 2**20:.0f} MiB",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: embedded)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="fp32")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument(
        "--linear",
        choices=["auto", "aten", "onednn", "fp16", "onednn+fp16"],
        default="auto",
        help="weight layout of the linears and LM head (model.linear; auto as the runner)",
    )
    parser.add_argument(
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        default="none",
        help="model.quantization as the runner resolves it (auto keeps a quantized GGUF so)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode steps through the compiled small-step graph (model.compile), each "
        "batch also timed eagerly",
    )
    parser.add_argument(
        "--no-bandwidth",
        action="store_true",
        help="skip the memory-bandwidth measurement (and the steps' weight-read floor)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also each batch's decode step broken down by torch's profiler",
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    args.read_gb_s = None
    if not args.no_bandwidth:
        args.read_gb_s, copy_gb_s = memory_bandwidth(args.repeats)
        print(
            f"memory bandwidth: read {args.read_gb_s:.1f} GB/s, copy {copy_gb_s:.1f} GB/s "
            f"({BANDWIDTH_BUFFER_MIB} MiB buffer)",
            flush=True,
        )
    dtypes = {
        "fp32": [torch.float32],
        "bf16": [torch.bfloat16],
        "both": [torch.float32, torch.bfloat16],
    }[args.dtype]
    with torch.inference_mode():
        for dtype in dtypes:
            start = time.perf_counter()
            config, model, lm_head, mode = _load(args, dtype)
            print(f"loaded in {time.perf_counter() - start:.1f} s", flush=True)
            _print_memory(args, model, lm_head)
            label = f"kvactor {str(dtype).removeprefix('torch.')}" + (f", {mode}" if mode else "")
            _print(label, bench_ours(config, model, args, lm_head), args)
            del model, lm_head
    if not args.no_hf:
        _print("hf transformers float32", bench_hf(args), args)


if __name__ == "__main__":
    main()
